"""Exercises for chapter 12: the dispatch's split sizes and rows, and the combine (both in ``ch12_dispatch``,
checked in one process and then inside a real expert-parallel forward on 2 gloo ranks), and a question on what
the balancing loss changes, answered by a measurement the checker makes. The reference answers are in
``solutions.py``."""

from __future__ import annotations

from typing import Any

import torch

from parallel_lib.exercises._core import CheckResult, Exercise, check_value, failed, show, solution
from parallel_lib.exercises.ch12_dispatch import COMBINE_STUB, DISPATCH_STUB, check_combine_rows, check_dispatch_rows
from parallel_lib.expert_parallel.moe import MoE, MoEConfig

__all__ = ["check_dispatch_rows", "check_combine_rows", "check_balance_effect", "measure_balance_effect",
           "EXERCISES"]

BALANCE_STUB = '''\
# A router sends 63 of 64 tokens to expert 0 of 4 (top-1). It is trained on the balancing loss alone for
# 30 steps, once with no capacity limit and once with capacity factor 1.0 (16 slots per expert).
# Compare the first step with the last. Which of these does the balancing loss change:
#   "total":   the rows the dispatch sends in all (the kept choices),
#   "busiest": the busiest expert's rows (the straggler every all-to-all waits for),
#   "both", or "neither"?
BALANCE_EFFECT = None  # your answer: dict(no_capacity="...", capacity="...")
'''
CHOICES = ("total", "busiest", "both", "neither")


def measure_balance_effect(capacity_factor: Any, steps: int = 30) -> dict[str, tuple[int, int]]:
    """The measurement behind the question: kept rows in all and the busiest expert's, at the first and last step.

    Returns:
        ``total`` and ``busiest``: (first step, last step).
    """
    moe = MoE(16, 32, MoEConfig(n_experts=4, top_k=1, capacity_factor=capacity_factor), seed=0)
    with torch.no_grad():
        moe.router.gate.weight[0] += 0.3  # the tokens lean towards +0.5: expert 0 scores highest
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1)) + 0.5
    optimizer = torch.optim.SGD(moe.router.parameters(), lr=0.03)
    counts = []
    for _ in range(steps):
        optimizer.zero_grad()
        moe(x)
        counts.append(moe.last.tokens_per_expert)
        moe.aux_loss.backward()
        optimizer.step()
    return dict(total=(int(counts[0].sum()), int(counts[-1].sum())),
                busiest=(int(counts[0].max()), int(counts[-1].max())))


def _changed(measured: dict[str, tuple[int, int]]) -> str:
    moved = [name for name, (first, last) in measured.items() if abs(last - first) > 0.1 * first]
    return {0: "neither", 2: "both"}.get(len(moved), moved[0] if moved else "neither")


def _normalise(answer: Any) -> dict[str, str]:
    if not isinstance(answer, dict) or set(answer) != {"no_capacity", "capacity"}:
        raise TypeError('dict(no_capacity="...", capacity="...")')
    for value in answer.values():
        if value not in CHOICES:
            raise ValueError(f"each answer one of {CHOICES}, got {value!r}")
    return dict(answer)


def check_balance_effect(answer: Any) -> CheckResult:
    """Measure both runs (:func:`measure_balance_effect`) and compare the answer with what changed."""
    if answer is None or answer is Ellipsis:  # not answered: nothing to measure yet
        return check_value("balance_effect", answer, "BALANCE_EFFECT", None)
    try:
        _normalise(answer)
    except (TypeError, ValueError) as error:
        return failed("balance_effect", None, f"BALANCE_EFFECT = {show(answer, 120)}, but the answer must be {error}")
    measured = {"no_capacity": measure_balance_effect(None), "capacity": measure_balance_effect(1.0)}
    expected = {case: _changed(m) for case, m in measured.items()}
    said = "; ".join(f"{case}: rows in all {m['total'][0]} → {m['total'][1]}, busiest expert {m['busiest'][0]} → "
                     f"{m['busiest'][1]}" for case, m in measured.items())

    def compare(expected: dict, got: dict) -> Any:
        wrong = [case for case in expected if got[case] != expected[case]]
        return None if not wrong else f"{wrong[0]}: measured {said}"

    def hint(got: dict) -> str:
        if got["no_capacity"] in ("total", "both"):
            return "without capacity every choice is computed: the rows in all are tokens × k, whatever the router"
        return "with capacity the busiest expert is capped at its slots; what do the dropped choices become?"
    result = check_value("balance_effect", answer, "BALANCE_EFFECT", expected, normalise=_normalise, compare=compare,
                         hint=hint)
    if result.passed:
        return CheckResult(result.exercise, True, f"{result.message} (measured {said})")
    return result


EXERCISES = [
    Exercise("dispatch_rows", check_dispatch_rows, DISPATCH_STUB, solution("dispatch_rows"),
             "Write the dispatch: from the router's choices and the capacity's `kept`, the split sizes of the "
             "all-to-all (rows per rank) and which token's which choice each row of the send buffer is. The checker "
             "compares with the library on 4 routings (drops, 4 ranks, an idle rank), then puts your function inside "
             "a real expert-parallel forward and backward on 2 gloo ranks."),
    Exercise("combine_rows", check_combine_rows, COMBINE_STUB, solution("combine_rows"),
             "Write the combine: the rows the reverse all-to-all brought back, weighted by the router and summed "
             "per token. The checker compares the output and the gradients (router, experts, input) with the "
             "one-process layer, then runs it on 2 gloo ranks."),
    Exercise("balance_effect", check_balance_effect, BALANCE_STUB, solution("BALANCE_EFFECT"),
             "What does the balancing loss change, with and without a capacity limit? Commit to an answer; the "
             "checker measures it."),
]
