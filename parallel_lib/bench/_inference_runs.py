"""What each rank of chapter 09's measurements runs: many serving jobs in ONE launch.

Starting gloo ranks and joining them into a group costs more than serving a few requests with the
tiny GPT-2. So the notebook and the benchmark launch their ranks once and run every job in them,
one after another: each job is one call of
:func:`~parallel_lib.inference.strategies.serve_worker`, the function :func:`~parallel_lib.inference.serve`
launches, so what is measured is exactly what ``serve`` runs. ``single`` and ``mp`` (in-process
strategies) run on rank 0 while the others wait, with the same single thread as every rank.

Also here: the all-reduce fit for the α–β model and this machine's FLOP/s and bandwidth, measured
in the same launch (one thread, like every rank).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from parallel_lib.bench._tp_runs import allreduce_fit
from parallel_lib.common.machine_speed import MachineSpeed, measure_machine_speed
from parallel_lib.inference.batch import Request
from parallel_lib.inference.strategies import ServeConfig, ServeRun, serve_worker
from parallel_lib.runtime.launcher import launch

__all__ = ["Job", "Measured", "make_requests", "serve_jobs", "collect", "measured", "launch_jobs", "median_runs"]

IN_PROCESS = ("single", "mp")


@dataclass(frozen=True)
class Job:
    """One serving run: a strategy on ``world_size`` ranks (or devices, for mp) of the launch."""

    strategy: str
    world_size: int
    requests: tuple[Request, ...]
    config: ServeConfig


@dataclass(frozen=True)
class Measured:
    """The numbers of one run, read from its requests' records."""

    strategy: str
    world_size: int
    concurrency: int
    ttft: float                 # mean over requests, seconds
    tpot: float                 # mean over requests, seconds per token after the first
    tokens_per_second: float    # every request's tokens over the time until the last one finished
    weights_per_device: int     # census, the fullest device
    kv_per_device: int          # census, the fullest device


def make_requests(n: int, prompt: int, new_tokens: int, vocab_size: int, seed: int = 0,
                  jitter: int = 0) -> tuple[Request, ...]:
    """``n`` greedy requests of ``prompt`` tokens (± ``jitter``, so prompts differ) asking ``new_tokens`` each."""
    g = torch.Generator().manual_seed(seed)
    lengths = [prompt + (int(torch.randint(-jitter, jitter + 1, (), generator=g)) if jitter else 0) for _ in range(n)]
    return tuple(Request(tuple(torch.randint(0, vocab_size, (max(1, k),), generator=g).tolist()),
                         max_new_tokens=new_tokens) for k in lengths)


def serve_jobs(rank: int, world_size: int, jobs: Sequence[Job], timeout: float, fit: bool = False,
               speed: bool = False) -> tuple[list[Any], Optional[tuple[float, float]], Optional[MachineSpeed]]:
    """Every job in turn on this rank; ``(per job (results, reports, seconds), all-reduce fit, machine speed)``.

    Every dp, pp or tp job must use all the launch's ranks; single and mp run on rank 0.
    """
    fitted = allreduce_fit(rank, world_size) if fit else None
    machine = measure_machine_speed() if speed and rank == 0 else None
    out: list[Any] = []
    for job in jobs:
        if job.strategy not in IN_PROCESS and job.world_size != world_size:
            raise ValueError(f"job {job.strategy} wants {job.world_size} ranks in a launch of {world_size}; "
                             "launch once per world size")
        dist.barrier()
        if job.strategy in IN_PROCESS:  # in this process, on rank 0; the others wait at the next barrier
            out.append(serve_worker(0, 1, job.strategy, list(job.requests), job.config, job.world_size, timeout)
                       if rank == 0 else ([], [], 0.0))
        else:
            out.append(serve_worker(rank, world_size, job.strategy, list(job.requests), job.config, world_size,
                                    timeout))
    return out, fitted, machine


def collect(jobs: Sequence[Job], per_rank: Sequence[Sequence[Any]]) -> list[ServeRun]:
    """One :class:`ServeRun` per job from every rank's ``(results, reports, seconds)``, results in request order;
    its seconds are the slowest rank's serving time (``serve_worker`` times between barriers)."""
    runs = []
    for j, job in enumerate(jobs):
        merged = {r.index: r for outputs in per_rank for r in outputs[j][0]}
        missing = [i for i in range(len(job.requests)) if i not in merged]
        if missing:
            raise RuntimeError(f"{job.strategy} on {job.world_size}: no rank returned requests {missing}")
        results = [merged[i] for i in range(len(job.requests))]
        seconds = max(outputs[j][2] for outputs in per_rank)
        runs.append(ServeRun(job.strategy, job.world_size, results,
                             [report for outputs in per_rank for report in outputs[j][1]], seconds))
    return runs


def measured(run: ServeRun) -> Measured:
    """The mean TTFT and TPOT over the requests, aggregate tokens/s, and the fullest device's census."""
    ok = [r for r in run.results if r.ok and r.token_times]
    tpots = [r.tpot for r in ok if not math.isnan(r.tpot)]
    return Measured(run.strategy, run.world_size, len(run.results), statistics.mean(r.ttft for r in ok),
                    statistics.mean(tpots) if tpots else math.nan, run.tokens_per_second(),
                    max(r.weight_bytes for r in run.ranks), max(r.kv_bytes for r in run.ranks))


def launch_jobs(jobs: Sequence[Job], world_size: int = 2, fit: bool = False, speed: bool = False,
                timeout: float = 300.0, warmup: bool = True) -> tuple[list[ServeRun], Any, Any]:
    """Launch ``world_size`` gloo ranks once (one thread each) and serve every job in them.

    Returns ``(one ServeRun per job, the all-reduce fit or None, this machine's speed or None)``. With
    ``warmup`` a throwaway single-device job runs first, so the first measured job does not pay for
    one-time costs (allocation, first calls).
    """
    first = [Job("single", 1, make_requests(1, 4, 2, jobs[0].config.vocab_size), jobs[0].config)] if warmup else []
    everything = first + list(jobs)
    outputs = launch(serve_jobs, world_size, everything, timeout, fit, speed, backend="gloo", threads_per_rank=1,
                     timeout=timeout)
    runs = collect(everything, [o[0] for o in outputs])[len(first):]
    return runs, outputs[0][1], outputs[0][2]


def median_runs(jobs: Sequence[Job], runs: Sequence[ServeRun], repeats: int) -> list[ServeRun]:
    """The median run (by tokens/s) of each job, for ``runs`` of ``list(jobs) * repeats``: a loaded machine's
    stalls land in single runs, and the median leaves them out."""
    if len(runs) != len(jobs) * repeats:
        raise ValueError(f"expected {len(jobs)} jobs x {repeats} repeats = {len(jobs) * repeats} runs, got {len(runs)}")
    return [sorted(runs[j::len(jobs)], key=lambda r: r.tokens_per_second())[repeats // 2] for j in range(len(jobs))]
