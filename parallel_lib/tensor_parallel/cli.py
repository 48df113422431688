"""``python -m parallel_lib.tensor_parallel``: tensor-parallel GPT-2 training from a shell, launched here or by torchrun.

Every :class:`TPConfig` field is a flag; the run is a plan of the one training entry
(:func:`parallel_lib.training.tp_layout`, run by :func:`parallel_lib.training.train_tp` on every rank).
Rank 0 prints the losses, tokens/s, this rank's collectives beside the formula's, the bytes it
holds, and with ``--check`` the largest difference between the gathered parameters and one
process trained on the same batches (:func:`parallel_lib.training.reference`)::

    python -m parallel_lib.tensor_parallel --world-size 2 --sequence-parallel --check
    torchrun --standalone --nproc-per-node 4 -m parallel_lib.tensor_parallel --tp 2 --check
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, replace
from typing import Optional

from parallel_lib.common.cli import add_config_flags
from parallel_lib.common.models import gpt2_config
from parallel_lib.runtime.environment import machine_label
from parallel_lib.runtime.launcher import RankInfo, is_torchrun, run
from parallel_lib.tensor_parallel.cost import GPTShape, step_collectives, wire_bytes
from parallel_lib.tensor_parallel.batches import TPConfig

__all__ = ["main"]


def main(argv: Optional[list[str]] = None) -> int:
    """Parse the flags, run the job (``launch`` or torchrun), print rank 0's summary; returns the exit status."""
    from parallel_lib.training import max_difference, reference, tp_layout, train_tp  # a higher layer: here only
    parser = argparse.ArgumentParser(prog="python -m parallel_lib.tensor_parallel", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=None, help="ranks to launch (default 2; under torchrun "
                        "its --nproc-per-node x --nnodes)")
    parser.add_argument("--threads-per-rank", type=int, default=None, help="torch threads per rank")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    parser.add_argument("--check", action="store_true", help="also train one process and compare the parameters")
    add_config_flags(parser, TPConfig)
    args = vars(parser.parse_args(argv))
    world_size = args.pop("world_size") or (None if is_torchrun() else 2)
    launch_kwargs = dict(threads_per_rank=args.pop("threads_per_rank"), timeout=args.pop("timeout"))
    check = args.pop("check")
    config = replace(TPConfig(), **args)
    if world_size is not None and config.tp and world_size % config.tp:  # before any rank starts; tp=0: all ranks
        parser.error(f"tp={config.tp} must divide world_size={world_size}: choose --world-size a multiple of --tp")
    results = run(train_tp, world_size, config, **launch_kwargs)
    if (RankInfo.from_env().rank if is_torchrun() else 0) != 0:
        return 0
    first = results[0]
    tp, dp = first.plan.tp, first.plan.dp
    print(f"tensor-parallel GPT-2 on {machine_label()}: tp={tp} dp={dp} "
          + ", ".join(f"{k}={v}" for k, v in asdict(config).items()))
    shares = [r.record.losses for r in results if r.coords["tp"] == 0]  # each replica's share of the global loss
    print(f"  losses          {[round(sum(step), 4) for step in zip(*shares)]}")
    print(f"  tokens/s        {first.record.describe_throughput(min(1, first.record.steps - 1))}")
    shape = GPTShape.of(gpt2_config(config.model, config.vocab_size, **config.overrides()))
    if dp == 1:
        expected = step_collectives(shape, config.batch_size, config.seq_len, tp, config.sequence_parallel)
        print(f"  collectives     {first.collectives} (formula {expected}: "
              f"{'equal' if expected == first.collectives else 'DIFFERENT'})")
        print(f"  sent per step   {first.wire_bytes / 1e6:.3f} MB (formula {wire_bytes(expected, tp) / 1e6:.3f} MB)")
    print(f"  parameters      {first.parameter_bytes / 1e6:.3f} MB on each rank")
    print(f"  activations     {first.activation_bytes / 1e6:.3f} MB saved for backward on rank 0")
    if check:
        losses, state = reference(tp_layout(config, dp * tp)[1], dp=dp)  # each replica its own dropout masks
        worst = max(max_difference(results, state).values())
        print(f"  one process     losses {[round(v, 4) for v in losses]}; largest parameter difference {worst:.2e}")
        if worst > 3e-4:
            print("  MISMATCH: the tensor-parallel run does not match one process")
            return 1
        print("  matches one process")
    return 0
