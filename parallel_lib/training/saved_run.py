"""A data-parallel run kept in a file: what ``python -m parallel_lib.data_parallel --save PATH`` and the
scale-out rehearsal (:mod:`parallel_lib.training.rehearsal`) write, and the summary they print.

A rehearsal compares a ``launch`` of N ranks with ``torchrun`` "nodes" that met over the
network: both save the same dict, one file per node, and the files must agree bit for bit.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from parallel_lib.runtime.launcher import RankInfo, is_torchrun
from parallel_lib.training.layouts import job_record
from parallel_lib.training.run import RunConfig, TrainResult

__all__ = ["checksum", "run_summary", "saved_run", "save_run"]


def checksum(result: TrainResult) -> float:
    """The sum of every parameter a rank returned (float64): equal replicas, equal sums.

    Raises:
        ValueError: the rank returned no parameters (run with ``return_state=True``).
    """
    if not result.state:
        raise ValueError(f"rank {result.rank} returned no parameters: run with return_state=True")
    return float(sum(t.double().sum() for t in result.state.values()))


def run_summary(results: Sequence[TrainResult], warmup: int = 2) -> dict[str, Any]:
    """The numbers a reader compares between runs: the job's steps, tokens/s after ``warmup`` steps
    (NaN for a run no longer than its warm-up), final global loss, and whether every replica ended
    with the same parameters (None when the ranks returned none)."""
    job = job_record(results)
    first = results[0]
    identical = len({checksum(r) for r in results}) == 1 if all(r.state for r in results) else None
    return dict(plan=first.plan.name, world_size=len(results), steps=job.steps,
                tokens_per_sec=job.throughput(skip=warmup), final_loss=job.final_loss, ranks_identical=identical)


def saved_run(results: Sequence[TrainResult], run: RunConfig, rank: int = 0) -> dict[str, Any]:
    """What :func:`save_run` writes: the job's numbers and rank ``rank``'s final parameters.

    Returns:
        ``{"rank", "world_size", "config", "summary", "checksums", "losses", "state"}``: the rank, the
        number of ranks, the plan's and the run's fields as one dict, :func:`run_summary`, every rank's
        :func:`checksum`, the job's loss per step, and the rank's parameters on the CPU.
    """
    mine = results[rank]
    return dict(rank=rank, world_size=len(results), config={**asdict(mine.plan), **asdict(run)},
                summary=run_summary(results), checksums=[checksum(r) for r in results],
                losses=list(job_record(results).losses), state=mine.state)


def save_run(results: Sequence[TrainResult], run: RunConfig, path: Path) -> Optional[dict[str, Any]]:
    """``torch.save`` this process's :func:`saved_run` to ``path``, once per host.

    Under torchrun every rank holds every result: the host's local rank 0 writes its own rank's
    file (one file per node), the other local ranks write nothing. Outside torchrun rank 0's
    result is written.

    Returns:
        What was saved, or None where this process saves nothing.
    """
    me = RankInfo.from_env() if is_torchrun() else RankInfo(0, 1, 0, 1)
    if me.local_rank != 0:
        return None
    saved = saved_run(results, run, me.rank)
    Path(path).parent.mkdir(parents=True, exist_ok=True)  # build/rehearsal/ on a fresh clone
    torch.save(saved, path)
    return saved
