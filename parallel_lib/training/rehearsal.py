"""Rehearse a multi-node data-parallel job on one machine: ``launch`` and ``torchrun`` must train alike.

Going from ``launch`` in a notebook to ``torchrun`` on several hosts changes who starts the
processes and how they find each other (a c10d rendezvous at one host's address), not what
each rank computes. A rehearsal checks exactly that: two ``torchrun`` launches on this machine
play two "nodes" that meet on the loopback interface, train the small :data:`REHEARSAL` run
of chapter 01 (the one training entry, ``Plan(dp=2, sync=...)``) as a ``launch`` of two ranks
does, and must end with the same parameters. This module's entry point trains it and saves the
result, one file per node (the file ``python -m parallel_lib.data_parallel --save PATH`` writes,
:func:`~parallel_lib.training.saved_run.save_run`)::

    python -m parallel_lib.training.rehearsal --out launch.pt              # 2 ranks from launch
    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:29500 --rdzv-id rehearsal -m parallel_lib.training.rehearsal --out node0.pt
    (the same with --out node1.pt, in a second terminal)

The c10d rendezvous numbers nodes in the order it settles on, not the order they were started,
so each file records the rank it holds. :func:`parallel_lib.data_parallel.torchrun_command`
writes the ``torchrun`` line.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from parallel_lib.runtime.launcher import RankInfo, is_torchrun, run
from parallel_lib.training.averagers import AVERAGERS
from parallel_lib.training.plan import Plan
from parallel_lib.training.run import RunConfig, check_layout, train
from parallel_lib.training.saved_run import save_run, saved_run

__all__ = ["REHEARSAL", "train_and_save", "main"]

# a few steps of the tiny model on a small slice of the corpus: seconds on one CPU core
REHEARSAL = RunConfig(data="corpus", model="tiny", batch_size=8, steps=3, train_examples=64, vocab_size=300,
                      seq_len=32, return_state=True)


def train_and_save(config: RunConfig, out: Optional[Path], world_size: Optional[int] = None, sync: str = "bucketed",
                   threads_per_rank: Optional[int] = 1, timeout: float = 120.0) -> dict[str, Any]:
    """Train ``config`` on ``Plan(dp=world_size, sync=sync)`` (launched here, or as this torchrun rank).

    Args:
        config: the run; its final parameters are kept whatever ``return_state`` says.
        out: where this node's local rank 0 saves the result with ``torch.save`` (None: nowhere).
        world_size: ranks to launch outside torchrun (default 2); under torchrun None.
        sync: chapter 01's gradient averager.
        threads_per_rank: torch threads per rank; equal thread counts give bit-equal results
            between a ``launch`` and a ``torchrun`` run.
        timeout: seconds for the launch, or for each collective under torchrun.

    Returns:
        :func:`~parallel_lib.training.saved_run.saved_run` of the rank this process is (0 outside
        torchrun): among others ``"rank"``, ``"world_size"``, every rank's ``"checksums"``, the job's
        ``"losses"`` per step and this rank's final ``"state"`` on the CPU.

    Raises:
        ValueError: a run or sync that cannot work (before any rank starts).
    """
    if world_size is None and not is_torchrun():
        world_size = 2
    replicas = world_size or RankInfo.from_env().world_size
    config, plan = replace(config, return_state=True), Plan(dp=replicas, sync=sync, micro_batches=1)
    check_layout(plan, config, replicas)
    results = run(train, world_size, plan, config, threads_per_rank=threads_per_rank, timeout=timeout)
    if out is not None:
        save_run(results, config, out)  # one file per node
    return saved_run(results, config, RankInfo.from_env().rank if is_torchrun() else 0)


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m parallel_lib.training.rehearsal [--out PATH]``, also as every rank of a torchrun job."""
    parser = argparse.ArgumentParser(prog="python -m parallel_lib.training.rehearsal",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="file for this node's result (torch.save)")
    parser.add_argument("--sync", choices=AVERAGERS, default="bucketed")
    parser.add_argument("--steps", type=int, default=REHEARSAL.steps, help="training steps")
    parser.add_argument("--world-size", type=int, help="ranks to launch (default 2; torchrun decides under torchrun)")
    parser.add_argument("--threads-per-rank", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds for the launch or each collective")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    saved = train_and_save(replace(REHEARSAL, steps=args.steps), args.out, args.world_size, args.sync,
                           args.threads_per_rank, args.timeout)
    if not is_torchrun() or RankInfo.from_env().local_rank == 0:  # one line per node
        checksums = saved["checksums"]
        print(f"rank {saved['rank']} of {saved['world_size']}: parameter checksum {checksums[saved['rank']]!r}, "
              f"all ranks equal: {len(set(checksums)) == 1}" + (f", saved to {args.out}" if args.out else ""))
    return 0


if __name__ == "__main__":
    # through the package's module, as in parallel_lib.runtime: one copy of train and RunConfig
    from parallel_lib.training.rehearsal import main as _main

    sys.exit(_main())
