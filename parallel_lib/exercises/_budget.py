"""The job chapter 10's exercises price: a Llama-style 8B model on A100 80 GB nodes, from published figures.

Every chapter 10 checker asks the planner (``price``, ``plan_layouts``) about this one model and card,
reads a student's layout the same way and names the term where a slower layout loses; they share
those here rather than each keeping a copy.
"""

from __future__ import annotations

from numbers import Integral
from typing import Any

from parallel_lib.planner.calibrate import Calibration
from parallel_lib.planner.hardware import GPUS, published_calibration
from parallel_lib.planner.layout import Priced, StepCost
from parallel_lib.cost.shape import GPTShape

__all__ = ["SHAPE", "SEQ", "GPU", "calibration_and_cost", "as_grid", "slower_hint"]

# the Llama-style 8B shape of parallel_lib.planner.published (sequence 4096), on A100 80 GB nodes of 8
SHAPE, SEQ, GPU = GPTShape(32, 4096, 32, 128256, 4096), 4096, "A100"


def calibration_and_cost() -> tuple[Calibration, StepCost, float]:
    """(the published calibration, a step cost at the card's peak bf16 rate, the card's memory in bytes)."""
    gpu = GPUS[GPU]
    return published_calibration(GPU), StepCost(0.0, gpu.flops_bf16), gpu.memory_gb * 1e9


def as_grid(answer: Any) -> tuple[int, int, int, int]:
    """``(dp, tp, pp, zero)`` of a student's ``dict(dp=..., tp=..., pp=..., zero=...)``; zero is 0 without dp.

    Raises:
        TypeError: not such a dict, or a value that is not a whole number; the message shows the form.
        ValueError: a size below 1 or a ZeRO stage outside 0-3.
    """
    if not isinstance(answer, dict) or not {"dp", "tp", "pp"} <= set(answer):
        raise TypeError("a dict with keys dp, tp, pp (and zero), e.g. dict(dp=8, tp=2, pp=2, zero=1)")
    for k in ("dp", "tp", "pp", "zero"):  # int(nan) raised its own words, int(2.5) and True passed as 2 and 1
        v = answer.get(k, 0)
        if isinstance(v, bool) or not isinstance(v, Integral):
            raise TypeError(f"whole numbers, got {k}={v!r}; e.g. dict(dp=8, tp=2, pp=2, zero=1)")
    values = tuple(int(answer.get(k, 0)) for k in ("dp", "tp", "pp", "zero"))
    if any(v < 1 for v in values[:3]) or values[3] not in (0, 1, 2, 3):
        raise ValueError("dp, tp, pp positive whole numbers and zero one of 0, 1, 2, 3")
    return values[0], values[1], values[2], values[3] if values[0] > 1 else 0


def slower_hint(ours: Priced, best: Priced) -> str:
    """Name the term where the chosen layout loses most against the best."""
    terms = {"the pipeline bubble": ours.compute * ours.bubble - best.compute * best.bubble,
             "the tensor-parallel all-reduces": ours.tp_comm - best.tp_comm,
             "the data-parallel (ZeRO) collectives": ours.dp_comm - best.dp_comm,
             "compute (recomputation or an unbalanced stage)": (ours.compute - ours.tp_comm) -
             (best.compute - best.tp_comm)}
    worst = max(terms, key=terms.__getitem__)
    return f"compare the predicted terms: yours loses most in {worst}"
