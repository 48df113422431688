"""Chapter 05's GPU check: data parallelism over pipelines on NCCL ranks trains like one process.

:func:`check_hybrid` runs every ``dp x pp`` layout of the GPUs (:func:`hybrid_grid`) with GPipe
and 1F1B, as plans of the one training entry (:func:`parallel_lib.training.train`), and compares each with
one process on the CPU (:func:`parallel_lib.training.reference`). :mod:`parallel_lib.gpu_checks`
registers it as ``hybrid``.
"""

from __future__ import annotations

from parallel_lib.common.tables import markdown_table
from parallel_lib.gpu_checks._reference import CheckError
from parallel_lib.runtime.launcher import launch

__all__ = ["hybrid_grid", "check_hybrid"]


def hybrid_grid(n_gpus: int) -> list[tuple[int, int]]:
    """``(dp, pp)`` layouts of ``n_gpus`` ranks chapter 05 runs: pipelines of 4, 2 and 1 stages (tiny has 4 layers)."""
    return [(n_gpus // p, p) for p in (4, 2, 1) if p <= n_gpus and n_gpus % p == 0]


def check_hybrid(n_gpus: int, quick: bool = False) -> str:
    """Chapter 05: DP over pipelines on NCCL ranks (one GPU each), plans of the one training entry; parameters vs
    one process on the CPU."""
    from parallel_lib.training import (Plan, RunConfig, job_record, max_difference, reference, summarize_layout,
                                       train_many)

    # AdamW with a large eps: its update then depends on the gradient's scale (a missed or doubled sync shows)
    run = RunConfig(data="corpus", vocab_size=300, seq_len=32 if quick else 64, batch_size=8 * n_gpus, steps=3,
                    train_examples=64 * n_gpus, lr=1e-2, eps=1e-3)
    jobs = [(Plan(dp=dp, pp=pp, schedule=schedule, micro_batches=4), run) for dp, pp in hybrid_grid(n_gpus)
            for schedule in (("1f1b", "gpipe") if pp > 1 else ("1f1b",))]
    per_rank = launch(train_many, n_gpus, jobs, timeout=300)
    rows = []
    for k, (plan, _) in enumerate(jobs):
        results = [runs[k] for runs in per_rank]
        worst = max(max_difference(results, reference(run, dp=plan.dp)[1]).values())
        if worst > 1e-4:  # float sums in another order: ~1e-6
            raise CheckError(f"{plan.dp} x {plan.pp} {plan.schedule} on {n_gpus} GPUs differs from one "
                             f"process by {worst:.3g}")
        rows.append([f"{plan.dp} x {plan.pp}", plan.schedule, f"{worst:.1e}",
                     f"{summarize_layout(results, warmup=0).traffic['pp'] / 1e6:.2f}",
                     f"{job_record(results).throughput():,.0f}"])
    return "\n".join([f"Data parallel over pipelines (chapter 05) on {n_gpus} ranks, tiny GPT-2, 3 AdamW steps: "
                      "parameters vs one process on the CPU:", "",
                      markdown_table(["dp x pp", "schedule", "max abs parameter difference", "MB sent stage to stage",
                                      "tokens/s"], rows, "llrrr")])
