"""``python -m parallel_lib.data_parallel``: data-parallel training from a shell, launched here or by torchrun.

Chapter 01's run on the one training entry: ``train(rank, world_size, Plan(dp=world_size,
sync=...), RunConfig(data="corpus", ...))``, each replica loading its ``partition_dataset`` part
of the course's corpus. Every :class:`~parallel_lib.training.RunConfig` field is a flag, ``--sync``
picks chapter 01's gradient averager, the summary is printed once (by rank 0), and ``--save PATH``
keeps the run in a file (:func:`~parallel_lib.training.saved_run.save_run`: one file per node
under torchrun), which the scale-out rehearsal (:mod:`parallel_lib.training.rehearsal`) compares
between ``launch`` and ``torchrun``::

    python -m parallel_lib.data_parallel --world-size 2 --sync bucketed --save run.pt
    torchrun --nproc-per-node 2 -m parallel_lib.data_parallel --sync ddp

The training entry lives in a higher layer than this folder: ``main`` imports it when the
command runs (chapter 01's lesson code, the averagers, stays importable without it).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, replace
from pathlib import Path
from typing import Optional

from parallel_lib.common.cli import add_config_flags
from parallel_lib.data import check_global_batch
from parallel_lib.runtime.environment import machine_label
from parallel_lib.runtime.launcher import RankInfo, is_torchrun, run

__all__ = ["main"]


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m parallel_lib.data_parallel [--world-size N] [--sync METHOD] [--save PATH] ...``; also under torchrun."""
    from parallel_lib.training import AVERAGERS, Plan, RunConfig, job_record, train
    from parallel_lib.training.run import check_layout
    from parallel_lib.training.saved_run import run_summary, save_run

    parser = argparse.ArgumentParser(prog="python -m parallel_lib.data_parallel", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=None, help="ranks to launch (default 2; "
                        "under torchrun its --nproc-per-node x --nnodes)")
    parser.add_argument("--sync", choices=AVERAGERS, default="bucketed", help="how replicas average gradients")
    parser.add_argument("--threads-per-rank", type=int, default=None, help="torch threads per rank")
    parser.add_argument("--launch-timeout", type=float, default=600.0, help="seconds for the whole run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of tokens/s (default 2)")
    parser.add_argument("--save", type=Path, metavar="PATH", help="torch.save the run there: config, summary, "
                        "checksums, losses and rank 0's final parameters (under torchrun: each node's first rank)")
    defaults = RunConfig(data="corpus", vocab_size=2048, seq_len=64, batch_size=32, steps=20)
    add_config_flags(parser, RunConfig, skip=("data", "timeline_steps", "return_state"))
    parser.set_defaults(**{k: v for k, v in asdict(defaults).items() if k not in ("timeline_steps", "return_state")})
    args = vars(parser.parse_args(argv))
    if args["warmup"] < 0:
        parser.error(f"--warmup must be >= 0, got {args['warmup']}")
    world_size = args.pop("world_size") or (None if is_torchrun() else 2)
    launch_kwargs = dict(threads_per_rank=args.pop("threads_per_rank"), timeout=args.pop("launch_timeout"))
    warmup, save, sync = args.pop("warmup"), args.pop("save"), args.pop("sync")
    config = replace(defaults, **args, return_state=True)  # the checksums compare the replicas
    replicas = world_size or RankInfo.from_env().world_size
    try:  # here, before any rank starts: otherwise every rank reports the same mistake after start-up
        check_global_batch(config.batch_size, replicas)
        plan = Plan(dp=replicas, sync=sync, micro_batches=1)
        check_layout(plan, config, replicas)
    except ValueError as error:
        parser.error(str(error).replace("batch_size=", "--batch-size "))
    results = run(train, world_size, plan, config, **launch_kwargs)
    if save is not None:
        save_run(results, config, save)
    if not is_torchrun() or RankInfo.from_env().rank == 0:  # under torchrun every rank has the results: print once
        summary = run_summary(results, warmup)
        summary["tokens_per_sec"] = job_record(results).describe_throughput(warmup)  # words, not "nan"
        print(f"data-parallel GPT-2 on {machine_label()}: sync={sync}, "
              + ", ".join(f"{k}={v}" for k, v in asdict(config).items()))
        for key, value in summary.items():
            print(f"  {key:<15} {value:,.3f}" if isinstance(value, float) else f"  {key:<15} {value}")
        if save is not None:
            print(f"  {'saved to':<15} {save}")
    return 0
