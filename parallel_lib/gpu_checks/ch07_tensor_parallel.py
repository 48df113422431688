"""Chapter 07's GPU check: GPT-2 split by heads (TP, TP + SP, TP x DP) on NCCL ranks trains like one process.

:mod:`parallel_lib.gpu_checks` registers :func:`check_tensor_parallel` as ``tensor_parallel``.
"""

from __future__ import annotations

from parallel_lib.common.compare import max_abs_difference
from parallel_lib.common.tables import markdown_table
from parallel_lib.gpu_checks._reference import CheckError
from parallel_lib.runtime.launcher import launch

__all__ = ["check_tensor_parallel"]


def check_tensor_parallel(n_gpus: int, quick: bool = False) -> str:
    """Chapter 07: tensor-parallel GPT-2 (with and without sequence parallelism) on ``n_gpus`` ranks trains like one process.

    tp is the largest of 4 and 2 that divides ``n_gpus`` (the tiny model has 4 heads); the
    other factor is data parallelism: a plan of the one training entry (``training.tp_layout``).
    The reference is one process on the CPU (``training.reference``).
    """
    from parallel_lib.tensor_parallel import TPConfig
    from parallel_lib.training import max_difference, reference, tp_layout, train

    tp = 4 if n_gpus % 4 == 0 else 2
    rows = []
    for sequence_parallel in (False, True):
        plan, run = tp_layout(TPConfig(tp=tp, sequence_parallel=sequence_parallel, steps=3 if quick else 6), n_gpus)
        results = launch(train, n_gpus, plan, run, timeout=300)
        losses, state = reference(run)
        worst = max(max_difference(results, state).values())
        shares = [r.record.losses for r in results if r.coords["tp"] == 0]  # each replica's share of the loss
        loss_gap = max_abs_difference([sum(a) for a in zip(*shares)], losses) / max(abs(b) for b in losses)  # inf: NaN
        if worst > 1e-3 or loss_gap > 1e-4:  # AdamW lifts float noise on near-zero gradients to ~lr (1e-3)
            raise CheckError(f"tensor parallel (tp={tp}, sequence_parallel={sequence_parallel}) on {n_gpus} ranks "
                             f"does not match one process: parameters differ by {worst:.3g}, losses by {loss_gap:.3g}")
        record = results[0].record
        rows.append([tp, plan.dp, "yes" if sequence_parallel else "no", f"{worst:.1e}", f"{loss_gap:.1e}",
                     f"{record.throughput(skip=1):,.0f}", f"{results[0].activation_bytes / 1e6:.2f}"])
    return "\n".join([f"Tensor parallelism on {n_gpus} ranks ({launch.__module__} picks NCCL with a GPU per rank): "
                      "the gathered parameters after AdamW steps match one process on the CPU:", "",
                      markdown_table(["tp", "dp", "sequence parallel", "max abs parameter difference",
                                      "max relative loss difference", "target tokens/s (every replica)",
                                      "activations MB (rank 0)"], rows, "rrlrrrr")])
