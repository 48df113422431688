"""The GPU check of chapter 10's 3D run: DP × TP × PP on NCCL ranks equals one process, traffic equals the formulas.

:mod:`parallel_lib.gpu_checks` registers :func:`check_grid3d`. The layout takes tp = 2 and
pp = 2 where the GPUs allow, the rest data parallelism (8 GPUs: 2 × 2 × 2), run as plans of the one
training entry (:func:`~parallel_lib.training.train_3d`); the reference is the one single-process
:func:`~parallel_lib.training.reference` (Hugging Face's dense GPT-2) on the CPU.
"""

from __future__ import annotations

from parallel_lib.common.tables import markdown_table
from parallel_lib.gpu_checks._reference import CheckError

__all__ = ["grid_for", "check_grid3d"]


def grid_for(n_devices: int) -> tuple[int, int, int]:
    """``(dp, tp, pp)`` for ``n_devices``: tp = 2 and pp = 2 when they divide it, dp the rest."""
    tp = 2 if n_devices % 2 == 0 else 1
    pp = 2 if (n_devices // tp) % 2 == 0 else 1
    return n_devices // (tp * pp), tp, pp


def check_grid3d(n_gpus: int, quick: bool = False) -> str:
    """Chapter 10: the 3D plan on ``n_gpus`` ranks; parameters vs one process, every axis's bytes and the census
    vs the formulas."""
    from parallel_lib.common.models import gpt2_config
    from parallel_lib.cost.shape import GPTShape
    from parallel_lib.training import RunConfig, job_step_times, max_difference, reference, train_3d
    from parallel_lib.pipeline_parallel.microbatch import stage_blocks
    from parallel_lib.training.traffic import dp_groups, expected_traffic, state_bytes

    dp, tp, pp = grid_for(n_gpus)
    model, vocab, seq = ("tiny", 128, 32) if quick else ("small", 512, 128)
    # AdamW with a large eps: its update then depends on the gradient's scale (a missing 1/dp or tied sum shows)
    run = RunConfig(model=model, vocab_size=vocab, seq_len=seq, batch_size=8 * dp, steps=3, lr=1e-2, eps=1e-3)
    expected_state = reference(run)[1]
    shape = GPTShape.of(gpt2_config(model, vocab))
    rows = []
    for schedule, recompute, zero in (("1f1b", False, 0), ("gpipe", True, 1)):
        m = 4
        results = train_3d(dp, tp, pp, model=model, schedule=schedule, recompute=recompute, zero=zero,
                           micro_batches=m, vocab_size=vocab, seq_len=seq, batch_size=run.batch_size,
                           steps=run.steps, lr=run.lr, eps=run.eps)
        worst = max(max_difference(results, expected_state).values())
        if worst > 1e-4:  # float noise only (~1e-7 on the CPU); a gradient twice too large moves them ~1e-3
            raise CheckError(f"{dp}x{tp}x{pp} {schedule} on {n_gpus} GPUs differs from one process by {worst:.3g}")
        for r in results:
            j = r.coords["pp"]
            blocks = len(stage_blocks(shape.n_layer, pp)[j])
            expected = expected_traffic(shape, dp, tp, pp, j, blocks, m, run.batch_size // dp // m, seq, recompute,
                                        zero)
            if {k: v for k, v in r.traffic.items() if v} != {k: v for k, v in expected.items() if v}:
                raise CheckError(f"rank {r.rank} {r.coords}: counted {r.traffic}, formula {expected}")
            census = state_bytes(dp_groups(shape, tp, blocks, j == 0, j == pp - 1, pp, zero, dp), zero, dp)
            if r.state_bytes != census:
                raise CheckError(f"rank {r.rank} {r.coords}: holds {r.state_bytes} bytes of model state, the "
                                 f"formula says {census}")
        times = job_step_times(results)[1:]
        rows.append([f"{dp} x {tp} x {pp}", schedule, "yes" if recompute else "no", str(zero), f"{worst:.1e}",
                     "equal", f"{1e3 * sum(times) / len(times):.1f}",
                     f"{max(r.state_bytes for r in results) / 1e6:.2f}"])
    return "\n".join([f"DP x TP x PP on {n_gpus} ranks (NCCL with a GPU each), {model} GPT-2: parameters after "
                      "3 AdamW steps vs one process on the CPU, every axis's collectives and the census vs chapter "
                      "10's formulas:", "",
                      markdown_table(["dp x tp x pp", "schedule", "recompute", "zero",
                                      "max abs parameter difference", "traffic and census vs formula", "ms per step",
                                      "model state MB (fullest rank)"], rows, "llllrlrr")])
