"""Exercises for chapter 08a (interleaving and zero-bubble): the weight gradient of a split backward,
run in every W of a ZB-H1 ``Pipe``, and the interleaved bubble (a warm-up) predicted before the
simulator measures it. The reference answers are in ``solutions.py``."""

from __future__ import annotations

from typing import Any

from parallel_lib.exercises._core import Case, CheckResult, Exercise, as_number, check_function, same_number, solution
from parallel_lib.exercises.ch08_split_backward import LINEAR_WEIGHT_GRAD_STUB, check_linear_weight_grad
from parallel_lib.pipeline_parallel.generators import interleaved_1f1b
from parallel_lib.pipeline_parallel.simulator import simulate_schedule

__all__ = ["check_interleaved_bubble", "check_linear_weight_grad", "EXERCISES"]

INTERLEAVED_STUB = '''\
def interleaved_bubble(p, m, v):
    """Bubble of interleaved 1F1B with p ranks, m micro-batches and v model stages per rank,
    relative to the ideal step m·(F+B) (every stage costs the same; m a multiple of p)."""
    ...  # your code here
'''


def check_interleaved_bubble(fn: Any) -> CheckResult:
    """Check ``interleaved_bubble(p, m, v)`` against the simulated interleaved schedule."""
    shapes = [(2, 4, 2), (4, 8, 2), (4, 8, 1), (3, 9, 3), (8, 16, 2)]
    cases = [Case(shape, simulate_schedule(interleaved_1f1b(*shape), (1.0, 2.0)).bubble) for shape in shapes]

    def hint(args: tuple, got: Any) -> str:
        p, m, v = args
        if isinstance(got, float) and abs(got - (p - 1) / m) < 1e-9:
            return "that is 1F1B's (p - 1) / m: with v stages per rank each fill step is 1/v as long"
        return "the fill and drain take (p - 1) stage-times of 1/v of a rank's share each"
    return check_function("interleaved_bubble", fn, "interleaved_bubble", cases, normalise=as_number,
                          compare=same_number, hint=hint)


EXERCISES = [
    Exercise("linear_weight_grad", check_linear_weight_grad, LINEAR_WEIGHT_GRAD_STUB, solution("linear_weight_grad"),
             "Write `linear_weight_grad(x, grad_y)`: the W of a split backward for one linear layer, the "
             "gradients of its weight and bias from the input F saved and the output gradient B received. "
             "The checker compares with autograd, then puts your function into every linear layer of a model "
             "trained on a ZB-H1 `Pipe` and compares every gradient with the unsplit model's."),
    Exercise("interleaved_bubble", check_interleaved_bubble, INTERLEAVED_STUB, solution("interleaved_bubble"),
             "Warm-up: write `interleaved_bubble(p, m, v)`, the bubble of interleaved 1F1B with v model stages "
             "per rank, as the simulator measures it."),
]
