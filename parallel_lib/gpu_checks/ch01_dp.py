"""Chapter 01's GPU check: every gradient-sync method on NCCL ranks trains like one process.

:func:`check_dp` trains the tiny GPT-2 with each of chapter 01's averagers (naive, bucketed, ring,
DDP) on one rank per GPU, through the one training entry (``Plan(dp=n_gpus, sync=...)``), compares
every rank's parameters with one process on the CPU (:func:`~parallel_lib.training.reference`),
then prints ``python -m parallel_lib.bench dp``'s table. :mod:`parallel_lib.gpu_checks` registers
it as ``dp``.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from parallel_lib.bench import dp as bench_dp
from parallel_lib.common.tables import markdown_table
from parallel_lib.gpu_checks._reference import max_difference
from parallel_lib.runtime.device import rank_device
from parallel_lib.runtime.launcher import launch
from parallel_lib.training import Plan, RunConfig, TrainResult, job_record, reference, train_many

__all__ = ["check_dp"]


def _ranks(rank: int, world_size: int, jobs: list) -> tuple[list[TrainResult], str]:
    """Every job on this rank, and the rank's device."""
    return train_many(rank, world_size, jobs), str(rank_device())


def check_dp(n_gpus: int, quick: bool = False) -> str:
    """Each sync method on ``n_gpus`` ranks trains like one process; then the DP benchmark."""
    methods = ("naive", "bucketed", "ring", "ddp")
    # SGD: a parameter's update is proportional to its gradient, so float noise stays noise
    # (Adam would blow a near-zero gradient's noise up to a full step) while a missed sync does not
    run = RunConfig(data="corpus", model="tiny", batch_size=4 * n_gpus, steps=3, train_examples=12 * n_gpus,
                    vocab_size=300, seq_len=32, optimizer="sgd", lr=0.1)
    per_rank = launch(_ranks, n_gpus, [(Plan(dp=n_gpus, sync=m, micro_batches=1), run) for m in methods],
                      timeout=300)
    losses, expected = reference(run, dp=n_gpus)
    rows = []
    for k, method in enumerate(methods):
        results = [runs[k] for runs, _ in per_rank]
        job = torch.tensor(job_record(results).losses)
        worst = max(max_difference((torch.tensor(losses), {n: expected[n] for n in r.state}), (job, r.state),
                                   f"sync={method!r} on rank {r.rank}") for r in results)
        identical = all(torch.equal(t, results[0].state[n]) for r in results for n, t in r.state.items())
        rows.append([method, f"{worst:.1e}", "yes" if identical else "no"])
    table = markdown_table(["sync", "max abs parameter difference", "ranks bit-identical"], rows, "lrl")
    results = bench_dp.measure(replace(bench_dp.QUICK if quick else bench_dp.Config(), world_size=n_gpus))
    return "\n".join([f"Data parallel, {n_gpus} ranks on {per_rank[0][1]} .. {per_rank[-1][1]}, "
                      f"{run.steps} SGD steps: every sync method's parameters match one process "
                      "on the CPU's:", "", table, "", bench_dp.markdown(results)])
