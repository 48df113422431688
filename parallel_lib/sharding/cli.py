"""``python -m parallel_lib.sharding``: ZeRO (or PyTorch's sharding) from a shell, launched here or by torchrun.

Every :class:`~parallel_lib.sharding.train.ShardConfig` field is a flag; rank 0 prints the
losses and, per rank, the model-state bytes the census counted beside the ZeRO formula and
the bytes sent per step beside the traffic formula::

    python -m parallel_lib.sharding --world-size 2 --stage 3
    torchrun --nproc-per-node 2 -m parallel_lib.sharding --stage 2 --collectives ring
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Optional, Sequence

from parallel_lib.common.cli import add_config_flags
from parallel_lib.common.tables import markdown_table
from parallel_lib.runtime.environment import machine_label
from parallel_lib.runtime.launcher import RankInfo, is_torchrun, run
from parallel_lib.sharding.memory import zero_memory, zero_traffic
from parallel_lib.sharding.train import STRATEGIES, ShardConfig, ShardResult, run_sharded
from parallel_lib.sharding.zero import COLLECTIVES, PRECISIONS, STAGES

__all__ = ["report", "main"]

_HIDDEN = ("freeze", "measure_step", "timeline", "return_state", "return_shards")
_CHOICES = dict(strategy=STRATEGIES, stage=STAGES, precision=PRECISIONS, collectives=COLLECTIVES)


def report(results: Sequence[ShardResult]) -> str:
    """The run as markdown: losses, then per rank census and wire bytes beside the formulas (MB = 1e6 bytes)."""
    first, n = results[0], len(results)
    config = first.config
    lines = [f"{config.strategy} stage {config.stage} ({config.precision}, {config.collectives} collectives), "
             f"GPT-2 {config.model}, {n} ranks, Ψ = {first.num_params:,} parameters",
             "losses: " + ", ".join(f"{loss:.4f}" for loss in first.record.losses), ""]
    stage = config.stage if config.strategy == "zero" else {"ddp": 0, "zero_redundancy": 1, "fsdp2": 3}[config.strategy]
    formula = zero_memory(first.num_params, n, stage, config.precision)
    traffic = zero_traffic(first.num_params, n, stage, config.precision)
    rows = [[r.rank] + [f"{r.census[k] / 1e6:.3f} / {formula[k] / 1e6:.3f}" for k in ("params", "grads", "optimizer")]
            + [f"{r.wire_bytes / 1e6:.3f} / {traffic / 1e6:.3f}", f"{r.record.throughput(skip=1):,.0f}"]
            for r in results]
    lines.append(markdown_table(["rank", "params MB (census / formula)", "grads MB", "optimizer MB",
                                 "sent per step MB (counted / formula)", "tokens/s"], rows, "rrrrrr"))
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m parallel_lib.sharding [--world-size N] [--stage S] ...``; also under torchrun."""
    parser = argparse.ArgumentParser(prog="python -m parallel_lib.sharding", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=None, help="ranks to launch (default 2; "
                        "under torchrun its --nproc-per-node x --nnodes)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    add_config_flags(parser, ShardConfig, skip=_HIDDEN, choices=_CHOICES)
    args = vars(parser.parse_args(argv))
    world_size = args.pop("world_size") or (None if is_torchrun() else 2)
    timeout = args.pop("timeout")
    args["steps"] = max(args["steps"], 2)  # step 1 is the measured one (after AdamW made its state)
    config = replace(ShardConfig(), **args, return_state=False)
    results = run(run_sharded, world_size, config, timeout=timeout)
    if (RankInfo.from_env().rank if is_torchrun() else 0) == 0:  # under torchrun every rank has the results
        print(f"sharded data parallelism on {machine_label()}")
        print(report(results))
    return 0
