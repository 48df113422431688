"""``python -m parallel_lib.sharding``: ZeRO (or PyTorch's sharding) from a shell, launched here or by torchrun.

The run is the one training entry's (``training.train`` with ``Plan(dp=N, zero=S, sync=...)``);
``--stage`` and ``--sync`` are the plan's, the other flags the run's (``training.RunConfig``).
Rank 0 prints the losses and, per rank, the model-state bytes the census counted beside the ZeRO
formula and the bytes sent in the last step beside the traffic formula::

    python -m parallel_lib.sharding --world-size 2 --stage 3
    torchrun --nproc-per-node 2 -m parallel_lib.sharding --stage 2 --collectives ring

Counts that cannot run (``--world-size 0``, ``--steps 1``, ``--batch-size 0``, ...) are refused
with the usage message before any rank starts.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional, Sequence

from parallel_lib.common.tables import markdown_table
from parallel_lib.sharding.memory import zero_memory, zero_traffic
from parallel_lib.sharding.zero import STAGES

__all__ = ["FORMULA_STAGE", "report", "main"]

# the ZeRO stage whose formula a dp axis's sync follows (None: Plan.zero's)
FORMULA_STAGE: dict[str, Optional[int]] = {"zero": None, "ddp": 0, "zero_redundancy": 1, "fsdp2": 3}

# RunConfig fields that are not flags here (set by the program, or about other chapters' runs)
_HIDDEN = ("n_layer", "n_embd", "dropout", "padding", "data", "train_examples", "data_seed", "timeout",
           "return_state", "timeline_steps", "freeze", "measure_step", "return_shards")


def report(results: Sequence[Any], run: Any) -> str:
    """The run as markdown: losses, then per rank census and wire bytes beside the formulas (MB = 1e6 bytes).

    Args:
        results: every rank's ``training.TrainResult`` of one run over dp only.
        run: its ``training.RunConfig``.
    """
    first, n = results[0], len(results)
    plan = first.plan
    stage = plan.zero if FORMULA_STAGE.get(plan.sync) is None else FORMULA_STAGE[plan.sync]
    losses = [sum(r.record.losses[k] for r in results) for k in range(len(first.record.losses))]
    lines = [f"{plan.sync} stage {stage} ({run.precision}, {run.collectives} collectives), GPT-2 {run.model}, "
             f"{n} ranks, Ψ = {first.trainable_parameters:,} parameters",
             "losses: " + ", ".join(f"{loss:.4f}" for loss in losses), ""]
    formula = zero_memory(first.trainable_parameters, n, stage, run.precision)
    traffic = zero_traffic(first.trainable_parameters, n, stage, run.precision)
    rows = [[r.rank] + [f"{r.census[k] / 1e6:.3f} / {formula[k] / 1e6:.3f}" for k in ("params", "grads", "optimizer")]
            + [f"{r.wire_bytes / 1e6:.3f} / {traffic / 1e6:.3f}", f"{r.record.throughput(skip=1):,.0f}"]
            for r in results]
    lines.append(markdown_table(["rank", "params MB (census / formula)", "grads MB", "optimizer MB",
                                 "sent per step MB (counted / formula)", "tokens/s"], rows, "rrrrrr"))
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m parallel_lib.sharding [--world-size N] [--stage S] ...``; also under torchrun."""
    from dataclasses import replace

    from parallel_lib.common.cli import add_config_flags
    from parallel_lib.common.checks import check_int
    from parallel_lib.runtime.environment import machine_label
    from parallel_lib.runtime.launcher import RankInfo, is_torchrun, run
    from parallel_lib.sharding.zero import COLLECTIVES, PRECISIONS
    from parallel_lib.training import SYNCS, Plan, RunConfig, train
    from parallel_lib.training.run import check_layout

    parser = argparse.ArgumentParser(prog="python -m parallel_lib.sharding", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=None, help="ranks to launch (default 2; "
                        "under torchrun its --nproc-per-node x --nnodes)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    parser.add_argument("--sync", choices=sorted(SYNCS), default="zero",
                        help="the dp axis: ZeRO's engine, or PyTorch's DDP, ZeroRedundancyOptimizer or FSDP2")
    parser.add_argument("--stage", type=int, choices=STAGES, default=2, help="ZeRO stage (--sync zero)")
    add_config_flags(parser, RunConfig, skip=_HIDDEN, choices=dict(precision=PRECISIONS, collectives=COLLECTIVES))
    args = vars(parser.parse_args(argv))
    world_size, timeout, sync, stage = (args.pop(k) for k in ("world_size", "timeout", "sync", "stage"))
    try:
        if world_size is not None:
            check_int("--world-size", world_size, 1)
        check_int("--steps", args["steps"], 2, hint="the census is of the last step, after AdamW's first step "
                  "made its state")
        ranks = world_size or (RankInfo.from_env().world_size if is_torchrun() else 2)
        config = replace(RunConfig(), **args, return_state=False)
        plan = Plan(dp=ranks, zero=stage, sync=sync, micro_batches=1)
        check_layout(plan, config, ranks)
    except ValueError as e:  # before any rank starts
        parser.error(str(e))
    results = run(train, None if is_torchrun() else ranks, plan, config, timeout=timeout)
    if (RankInfo.from_env().rank if is_torchrun() else 0) == 0:  # under torchrun every rank has the results
        print(f"sharded data parallelism on {machine_label()}")
        print(report(results, config))
    return 0
