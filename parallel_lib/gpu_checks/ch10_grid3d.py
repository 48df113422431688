"""The GPU check of chapter 10's 3D run: DP × TP × PP on NCCL ranks equals one process, traffic equals the formulas.

:mod:`parallel_lib.gpu_checks` registers :func:`check_grid3d`. The layout takes tp = 2 and
pp = 2 where the GPUs allow, the rest data parallelism (8 GPUs: 2 × 2 × 2); the reference is
Hugging Face's dense GPT-2 in one process on the CPU.
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
    """Chapter 10: the 3D run on ``n_gpus`` ranks; parameters vs one process, every group's bytes vs the formula."""
    from parallel_lib.common.models import gpt2_config
    from parallel_lib.hybrid.cost3d import expected_traffic
    from parallel_lib.hybrid.dp_tp_pp import Config3D
    from parallel_lib.hybrid.layout3d import job_step_times, max_difference, reference_3d, train_3d
    from parallel_lib.tensor_parallel.cost import GPTShape

    dp, tp, pp = grid_for(n_gpus)
    model, vocab, seq = ("tiny", 128, 32) if quick else ("small", 512, 128)
    rows = []
    for schedule, recompute, optimizer, lr in (("1f1b", False, "sgd", 0.5), ("gpipe", True, "adamw", 1e-3)):
        fields = dict(vocab_size=vocab, seq_len=seq, batch_size=8 * dp, micro_batches=4, optimizer=optimizer, lr=lr,
                      steps=3, return_state=True)
        results = train_3d(dp, tp, pp, model=model, schedule=schedule, recompute=recompute, **fields)
        config: Config3D = results[0].config
        worst = max(max_difference(results, reference_3d(config)[1]).values())
        # SGD: float noise only (~1e-6); AdamW lifts noise on near-zero gradients towards lr
        if worst > (1e-4 if optimizer == "sgd" else 1e-3):
            raise CheckError(f"{dp}x{tp}x{pp} {schedule} on {n_gpus} GPUs differs from one process by {worst:.3g}")
        shape = GPTShape.of(gpt2_config(model, vocab))
        for r in results:
            expected = expected_traffic(shape, dp, tp, pp, r.coords[1], len(r.blocks), config.micro_batches,
                                        config.batch_size // dp // config.micro_batches, seq, recompute)
            if {k: v for k, v in r.traffic.items() if v} != {k: v for k, v in expected.items() if v}:
                raise CheckError(f"rank {r.rank} {r.coords}: counted {r.traffic}, formula {expected}")
        times = job_step_times(results)[1:]
        rows.append([f"{dp} x {tp} x {pp}", schedule, "yes" if recompute else "no", optimizer, f"{worst:.1e}",
                     "equal", f"{1e3 * sum(times) / len(times):.1f}",
                     f"{max(r.state_bytes for r in results) / 1e6:.2f}"])
    return "\n".join([f"DP x TP x PP on {n_gpus} ranks (NCCL with a GPU each), {model} GPT-2: parameters after "
                      "3 steps vs one process on the CPU, every group's collectives vs chapter 10's formulas:", "",
                      markdown_table(["dp x tp x pp", "schedule", "recompute", "optimizer",
                                      "max abs parameter difference", "traffic vs formula", "ms per step",
                                      "model state MB (fullest rank)"], rows, "llllrlrr")])
