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
import math
from dataclasses import asdict, replace
from typing import Optional

from parallel_lib.common.checks import positive_int, positive_number
from parallel_lib.common.cli import add_config_flags
from parallel_lib.common.compare import max_abs_difference
from parallel_lib.common.models import gpt2_config
from parallel_lib.runtime.environment import machine_label
from parallel_lib.runtime.launcher import RankInfo, is_torchrun, run
from parallel_lib.cost.shape import GPTShape
from parallel_lib.tensor_parallel.cost import step_collectives, wire_bytes
from parallel_lib.tensor_parallel.batches import TPConfig

__all__ = ["main"]


def main(argv: Optional[list[str]] = None) -> int:
    """Parse the flags, run the job (``launch`` or torchrun), print rank 0's summary; returns the exit status."""
    from parallel_lib.training import max_difference, reference, tp_layout, train_tp  # a higher layer: here only
    from parallel_lib.training.run import check_layout
    parser = argparse.ArgumentParser(prog="python -m parallel_lib.tensor_parallel", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=None, help="ranks to launch (default 2; under torchrun "
                        "its --nproc-per-node x --nnodes)")
    parser.add_argument("--threads-per-rank", type=int, default=None, help="torch threads per rank")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    parser.add_argument("--check", action="store_true", help="also train one process and compare the parameters")
    add_config_flags(parser, TPConfig)
    args = vars(parser.parse_args(argv))
    world_size = args.pop("world_size")  # None: the default; 0 is refused below, not replaced
    if world_size is None:
        world_size = RankInfo.from_env().world_size if is_torchrun() else 2
    launch_kwargs = dict(threads_per_rank=args.pop("threads_per_rank"), timeout=args.pop("timeout"))
    check = args.pop("check")
    config = replace(TPConfig(), **args)
    try:  # here, before any rank starts: what would otherwise fail inside every rank
        positive_number("timeout", launch_kwargs["timeout"], hint="seconds for the whole run")
        if launch_kwargs["threads_per_rank"] is not None:
            positive_int("threads_per_rank", launch_kwargs["threads_per_rank"])
        plan, run_config = tp_layout(config, world_size)
        check_layout(plan, run_config, world_size)
    except (ValueError, TypeError) as error:
        parser.error(str(error))
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
        losses, state = reference(run_config, dp=dp)  # each replica its own dropout masks
        worst = max(max_difference(results, state).values())  # inf when a parameter is NaN or infinite
        ours = [sum(step) for step in zip(*shares)]
        print(f"  one process     losses {[round(v, 4) for v in losses]}; largest parameter difference {worst:.2e}")
        if not all(math.isfinite(v) for v in [worst, *ours, *losses]):  # nan > 3e-4 is False: never let it pass
            print("  MISMATCH: a loss or a parameter is NaN or infinite (the training diverged: try a smaller --lr)")
            return 1
        if worst > 3e-4 or max_abs_difference(ours, losses) > 1e-4 * max(abs(v) for v in losses):
            print("  MISMATCH: the tensor-parallel run does not match one process")
            return 1
        print("  matches one process")
    return 0
