"""Chapter 01's GPU check: every gradient-sync method on NCCL ranks trains like one process.

:func:`check_dp` trains the tiny GPT-2 with each sync method (naive, bucketed, ring, DDP) on one
rank per GPU, compares every rank's parameters with one process on the CPU, then prints
``python -m parallel_lib.bench dp``'s table. :mod:`parallel_lib.gpu_checks` registers it as ``dp``.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from parallel_lib.bench import dp as bench_dp
from parallel_lib.common.tables import markdown_table
from parallel_lib.data_parallel.dp import DPConfig, run_dp_many
from parallel_lib.data_parallel.dp_reference import single_process_reference
from parallel_lib.gpu_checks._reference import max_difference
from parallel_lib.runtime.launcher import launch

__all__ = ["check_dp"]


def check_dp(n_gpus: int, quick: bool = False) -> str:
    """Each sync method on ``n_gpus`` ranks trains like one process; then the DP benchmark."""
    methods = ("naive", "bucketed", "ring", "ddp")
    # SGD: a parameter's update is proportional to its gradient, so float noise stays noise
    # (Adam would blow a near-zero gradient's noise up to a full step) while a missed sync does not
    config = DPConfig(model="tiny", batch_size=4 * n_gpus, max_steps=3, train_examples=12 * n_gpus,
                      val_examples=8, vocab_size=300, max_length=32, optimizer="sgd", lr=0.1, return_state=True)
    per_rank = launch(run_dp_many, n_gpus, [replace(config, sync=m) for m in methods], timeout=300)
    expected_record, expected = single_process_reference(n_gpus, config)
    reference = (torch.tensor(expected_record.losses), expected)
    rows = []
    for k, method in enumerate(methods):
        worst = max(max_difference(reference, (torch.tensor(runs[k].record.losses), runs[k].state or {}),
                                   f"sync={method!r} on rank {runs[k].rank}") for runs in per_rank)
        identical = len({runs[k].checksum for runs in per_rank}) == 1
        rows.append([method, f"{worst:.1e}", "yes" if identical else "no"])
    table = markdown_table(["sync", "max abs parameter difference", "ranks bit-identical"], rows, "lrl")
    results = bench_dp.measure(replace(bench_dp.QUICK if quick else bench_dp.Config(), world_size=n_gpus))
    return "\n".join([f"Data parallel, {n_gpus} ranks on {per_rank[0][0].device} .. {per_rank[-1][0].device}, "
                      f"{expected_record.steps} SGD steps: every sync method's parameters match one process "
                      "on the CPU's:", "", table, "", bench_dp.markdown(results)])
