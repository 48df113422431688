"""Chapter 05's GPU check: data parallelism over pipelines on NCCL ranks trains like one process.

:func:`check_hybrid` runs every ``dp x pp`` layout of the GPUs (:func:`hybrid_grid`) with GPipe
and 1F1B and compares each with one process on the CPU. :mod:`parallel_lib.gpu_checks`
registers it as ``hybrid``.
"""

from __future__ import annotations

from dataclasses import replace

from parallel_lib.common.tables import markdown_table
from parallel_lib.gpu_checks._reference import CheckError
from parallel_lib.runtime.launcher import launch

__all__ = ["hybrid_grid", "check_hybrid"]


def hybrid_grid(n_gpus: int) -> list[tuple[int, int]]:
    """``(dp, pp)`` layouts of ``n_gpus`` ranks chapter 05 runs: pipelines of 4, 2 and 1 stages (tiny has 4 layers)."""
    return [(n_gpus // p, p) for p in (4, 2, 1) if p <= n_gpus and n_gpus % p == 0]


def check_hybrid(n_gpus: int, quick: bool = False) -> str:
    """Chapter 05: DP over pipelines on NCCL ranks (one GPU each); parameters vs one process on the CPU."""
    from parallel_lib.hybrid.dp_pp import HybridConfig, run_hybrid_many
    from parallel_lib.hybrid.results import compare_with_reference, summarize
    from parallel_lib.training import RunConfig, reference

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
        _, expected = reference(RunConfig(**config.one_process_fields()), dp=config.dp)
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
