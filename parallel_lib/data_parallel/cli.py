"""``python -m parallel_lib.data_parallel``: data-parallel training from a shell, launched here or by torchrun.

The command line of :mod:`parallel_lib.data_parallel.dp`: every :class:`DPConfig` field is a
flag, the summary is printed once (by rank 0), and ``--save PATH`` keeps the run in a file
(:func:`save_run`: one file per node under torchrun), which the scale-out rehearsal
(:mod:`parallel_lib.data_parallel.scaleout`) compares between ``launch`` and ``torchrun``::

    python -m parallel_lib.data_parallel --world-size 2 --sync bucketed --save run.pt
    torchrun --nproc-per-node 2 -m parallel_lib.data_parallel --sync ddp
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from parallel_lib.common.cli import add_config_flags
from parallel_lib.data import check_global_batch
from parallel_lib.data_parallel.dp import SYNC_METHODS, DPConfig, DPResult, run_dp
from parallel_lib.data_parallel.dp_reference import summarize
from parallel_lib.runtime.environment import machine_label
from parallel_lib.runtime.launcher import RankInfo, is_torchrun, run

__all__ = ["saved_run", "save_run", "main"]


def _this_rank() -> RankInfo:
    """This process in the job: from torchrun's environment, else rank 0 of a ``launch`` (one host)."""
    return RankInfo.from_env() if is_torchrun() else RankInfo(0, 1, 0, 1)


def saved_run(results: Sequence[DPResult], rank: int = 0) -> dict[str, Any]:
    """What :func:`save_run` writes: the job's numbers and rank ``rank``'s final parameters.

    Returns:
        ``{"rank", "world_size", "config", "summary", "checksums", "losses", "state"}``: the rank,
        the number of ranks, the config as a dict, :func:`summarize`'s numbers, every rank's
        parameter checksum, the job's loss per step, and the rank's ``state_dict`` on the CPU
        (None unless the run kept it, ``return_state=True``).
    """
    mine = results[rank]
    return dict(rank=rank, world_size=len(results), config=asdict(mine.config), summary=summarize(results),
                checksums=[r.checksum for r in results], losses=list(mine.record.losses), state=mine.state)


def save_run(results: Sequence[DPResult], path: Path) -> Optional[dict[str, Any]]:
    """``torch.save`` this process's :func:`saved_run` to ``path``, once per host.

    Under torchrun every rank holds every result: the host's local rank 0 writes its own
    rank's file (one file per node), the other local ranks write nothing. Outside torchrun
    rank 0's result is written.

    Returns:
        What was saved, or None where this process saves nothing.
    """
    me = _this_rank()
    if me.local_rank != 0:
        return None
    saved = saved_run(results, me.rank)
    Path(path).parent.mkdir(parents=True, exist_ok=True)  # build/rehearsal/ on a fresh clone
    torch.save(saved, path)
    return saved


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m parallel_lib.data_parallel [--world-size N] [--sync METHOD] [--save PATH] ...``; also under torchrun."""
    parser = argparse.ArgumentParser(prog="python -m parallel_lib.data_parallel", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=None, help="ranks to launch (default 2; "
                        "under torchrun its --nproc-per-node x --nnodes)")
    parser.add_argument("--threads-per-rank", type=int, default=None, help="torch threads per rank")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of tokens/s (default 2)")
    parser.add_argument("--save", type=Path, metavar="PATH", help="torch.save the run there: config, summary, "
                        "checksums, losses and rank 0's final parameters (under torchrun: each node's first rank)")
    defaults = DPConfig()
    add_config_flags(parser, DPConfig, skip=("timeline_steps", "return_state"), choices=dict(sync=SYNC_METHODS),
                     types=dict(model=str, max_steps=int, train_examples=int))
    args = vars(parser.parse_args(argv))
    if args["warmup"] < 0:
        parser.error(f"--warmup must be >= 0, got {args['warmup']}")
    world_size = args.pop("world_size") or (None if is_torchrun() else 2)
    launch_kwargs = dict(threads_per_rank=args.pop("threads_per_rank"), timeout=args.pop("timeout"))
    warmup, save = args.pop("warmup"), args.pop("save")
    config = replace(defaults, **args, return_state=save is not None)
    try:  # here, before any rank starts: otherwise every rank reports the same mistake after start-up
        check_global_batch(config.batch_size, world_size or _this_rank().world_size)
    except ValueError as error:
        parser.error(str(error).replace("batch_size=", "--batch-size "))
    results = run(run_dp, world_size, config, **launch_kwargs)
    if save is not None:
        save_run(results, save)
    if _this_rank().rank == 0:  # under torchrun every rank has the results: print once
        summary = summarize(results, warmup)
        summary["tokens_per_sec"] = results[0].record.describe_throughput(warmup)  # words, not "nan"
        print(f"data-parallel GPT-2 on {machine_label()}: " + ", ".join(f"{k}={v}" for k, v in asdict(config).items()))
        for key, value in summary.items():
            if isinstance(value, list):
                value = [round(v, 3) for v in value]
            print(f"  {key:<15} {value:,.1f}" if isinstance(value, float) else f"  {key:<15} {value}")
        if save is not None:
            print(f"  {'saved to':<15} {save}")
    return 0
