"""The GPU checks of chapters 00 and 05, so that ``check_gpu`` covers every chapter.

:mod:`parallel_lib.check_gpu` registers :func:`check_setup` (chapter 00: ranks on NCCL sum
a tensor, and the tiny GPT-2 trains on ``cuda:0``) and :func:`check_hybrid` (chapter 05:
data parallelism over pipelines on NCCL ranks trains like one process). Chapters 01–04
are in :mod:`parallel_lib.gpu_checks`, 06–08 in :mod:`parallel_lib.gpu_checks_part2`.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from parallel_lib.common.tables import markdown_table
from parallel_lib.gpu_checks._reference import CheckError
from parallel_lib.runtime.device import resolve_device
from parallel_lib.runtime.launcher import launch

__all__ = ["check_setup", "hybrid_grid", "check_hybrid"]


def check_setup(n_gpus: int, quick: bool = False) -> str:
    """Chapter 00: an all-reduce over ``n_gpus`` NCCL ranks, then the tiny GPT-2's first run on one GPU."""
    from parallel_lib.quickstart import tiny_run
    from parallel_lib.runtime.environment import all_reduce_demo

    per_rank = launch(all_reduce_demo, n_gpus, timeout=120) if n_gpus > 1 else []
    expected = n_gpus * (n_gpus + 1) / 2
    for rank, _, after in per_rank:
        if not torch.equal(after, torch.full((2,), expected)):
            raise CheckError(f"rank {rank}: all-reduce gave {after.tolist()}, expected {expected} everywhere")
    steps = 10 if quick else 40
    record = tiny_run(steps=steps, device=resolve_device(0))
    if not record.final_loss < record.losses[0]:
        raise CheckError(f"the tiny GPT-2 did not learn on {resolve_device(0)}: loss {record.losses[0]:.2f} -> "
                         f"{record.final_loss:.2f}")
    rows = [["all-reduce of [rank + 1] (NCCL on GPUs)", f"{n_gpus} ranks",
             f"{expected:g} on every rank" if per_rank else "skipped: one GPU"],
            [f"tiny GPT-2, {steps} steps", str(resolve_device(0)),
             f"loss {record.losses[0]:.2f} -> {record.final_loss:.2f}, {record.throughput(skip=2):,.0f} tokens/s"]]
    return "\n".join(["Set-up (chapter 00):", "", markdown_table(["run", "where", "result"], rows, "lll")])


def hybrid_grid(n_gpus: int) -> list[tuple[int, int]]:
    """``(dp, pp)`` layouts of ``n_gpus`` ranks chapter 05 runs: pipelines of 4, 2 and 1 stages (tiny has 4 layers)."""
    return [(n_gpus // p, p) for p in (4, 2, 1) if p <= n_gpus and n_gpus % p == 0]


def check_hybrid(n_gpus: int, quick: bool = False) -> str:
    """Chapter 05: DP over pipelines on NCCL ranks (one GPU each); parameters vs one process on the CPU."""
    from parallel_lib.data_parallel.dp_reference import single_process_reference
    from parallel_lib.hybrid.dp_pp import HybridConfig, run_hybrid_many
    from parallel_lib.hybrid.results import compare_with_reference, summarize

    # SGD: an update proportional to the gradient, so a missed or doubled sync shows (see check_dp)
    base = HybridConfig(micro_batches=4, batch_size=8 * n_gpus, steps=3, train_examples=64 * n_gpus,
                        vocab_size=300, max_length=16 if quick else 32, optimizer="sgd", lr=0.5,
                        return_state=True)
    configs = [replace(base, dp=dp, pp=pp, schedule=schedule) for dp, pp in hybrid_grid(n_gpus)
               for schedule in (("1f1b", "gpipe") if pp > 1 else ("1f1b",))]
    per_rank = launch(run_hybrid_many, n_gpus, configs, timeout=300)
    rows = []
    for k, config in enumerate(configs):
        results = [runs[k] for runs in per_rank]
        _, expected = single_process_reference(config.dp, config.dp_config())
        worst = max(compare_with_reference(results, expected).values())
        if worst > 1e-4:  # float sums in another order: ~1e-6
            raise CheckError(f"{config.dp} x {config.pp} {config.schedule} on {n_gpus} GPUs differs from one "
                             f"process by {worst:.3g}")
        summary = summarize(results)
        rows.append([f"{config.dp} x {config.pp}", config.schedule, f"{worst:.1e}",
                     f"{summary['bytes_p2p'] / 1e6:.2f}", f"{summary['tokens_per_sec']:,.0f}"])
    return "\n".join([f"Data parallel over pipelines (chapter 05) on {n_gpus} ranks, tiny GPT-2, 3 SGD steps: "
                      "parameters vs one process on the CPU:", "",
                      markdown_table(["dp x pp", "schedule", "max abs parameter difference", "MB sent stage to stage",
                                      "tokens/s"], rows, "llrrr")])
