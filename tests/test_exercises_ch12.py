"""Chapter 12's exercises: each checker passes the reference (on 2 gloo ranks) and names the typical wrong answers
(in one process, before any rank starts); the balance question is answered by the checker's own measurement.

Wrong answers are written as a student writes them in a cell (``notebook_function``), so the checkers ship them
to their ranks as they would from a kernel.
"""

import pytest

from parallel_lib import exercises
from parallel_lib.exercises import EXERCISES
from test_exercises import notebook_function  # the same module pytest collects: one counter of cell names

_DISPATCH = '''
import torch

def dispatch_rows(experts, kept, n_experts, ep):
    token, slot = torch.nonzero({kept}, as_tuple=True)
    order = {order}
    token, slot = token[order], slot[order]
    counts = torch.bincount(experts[token, slot], minlength=n_experts)
    send = {send}
    return send.tolist(), token, slot
'''
_DISPATCH_RIGHT = dict(kept="kept", order="torch.argsort(experts[token, slot], stable=True)",
                       send="counts.reshape(ep, n_experts // ep).sum(dim=1)")


def _dispatch(**changes):
    return notebook_function(_DISPATCH.format(**{**_DISPATCH_RIGHT, **changes}))


_COMBINE = '''
import torch

def combine_rows(back, token, slot, weights, n_tokens):
    {body}
'''
_COMBINE_RIGHT = ("return back.new_zeros(n_tokens, back.shape[1]).index_add(0, token, "
                  "weights[token, slot].unsqueeze(1) * back)")


def _combine(body=_COMBINE_RIGHT):
    return notebook_function(_COMBINE.format(body=body))


@pytest.mark.parametrize("answer, fragments", [
    (dict(send="counts"), ["send = ", "has one size per expert, not one per rank (2)", "add up the counts"]),
    (dict(kept="torch.ones_like(kept)"), ["case '4 experts, top-2, 2 ranks, capacity 1.0 (drops)'",
                                          "choices capacity dropped were sent too"]),
    (dict(order="torch.arange(len(token))"), ["the rows are not sorted by expert"]),
    (dict(send="torch.bincount(experts[token, slot] % ep, minlength=ep)"), ["puts expert e on rank e % ep"]),
], ids=["per-expert", "capacity-ignored", "unsorted", "round-robin"])
def test_dispatch_rows_names_each_wrong_answer(answer, fragments):
    result = exercises.check_dispatch_rows(_dispatch(**answer))
    assert not result.passed and result.message.startswith("❌ dispatch_rows")
    for fragment in fragments:
        assert fragment in result.message, result.message


@pytest.mark.parametrize("body, fragments", [
    ("return back.new_zeros(n_tokens, back.shape[1]).index_add(0, token, back)",
     ["summed without the router's weights"]),
    ("return back.new_zeros(n_tokens, back.shape[1]).index_add(0, token, weights[token, 0].unsqueeze(1) * back)",
     ["case '4 experts, top-2", "every row got its token's first weight"]),
    ("y = back.new_zeros(n_tokens, back.shape[1])\n    y[token] = weights[token, slot].unsqueeze(1) * back\n"
     "    return y", ["overwrote each other", "index_add"]),
    (_COMBINE_RIGHT.replace("weights[token, slot]", "weights.detach()[token, slot]"),
     ["the router's gradient is not", "no .detach()"]),
    ("return (weights[token, slot].unsqueeze(1) * back).sum(0)", ["returned Tensor of shape (16,)"]),
], ids=["unweighted", "first-weight", "overwritten", "detached", "shape"])
def test_combine_rows_names_each_wrong_answer(body, fragments):
    result = exercises.check_combine_rows(_combine(body))
    assert not result.passed and result.message.startswith("❌ combine_rows")
    for fragment in fragments:
        assert fragment in result.message, result.message


def test_the_balance_question_is_answered_by_the_measurement():
    from parallel_lib.exercises.ch12 import measure_balance_effect
    free, capped = measure_balance_effect(None), measure_balance_effect(1.0)
    assert free["total"] == (64, 64) and free["busiest"][0] == 63 and free["busiest"][1] < 25
    assert capped["busiest"] == (16, 16) and capped["total"][0] == 17 and capped["total"][1] > 55
    right = exercises.check_balance_effect(dict(no_capacity="busiest", capacity="total"))
    assert right.passed and "busiest expert 63 → " in right.message, right.message
    wrong = exercises.check_balance_effect(dict(no_capacity="both", capacity="total"))
    assert not wrong.passed and "tokens × k, whatever the router" in wrong.message, wrong.message
    assert "not answered yet" in exercises.check_balance_effect(None).message
    assert "each answer one of" in exercises.check_balance_effect(dict(no_capacity="all", capacity="x")).message


def test_chapter_12_registry_and_stubs():
    from parallel_lib.exercises import solutions
    items = {item.name: item for item in EXERCISES["12"]}
    assert list(items) == ["dispatch_rows", "combine_rows", "balance_effect"]
    for item in items.values():
        assert any(getattr(solutions, name) is item.solution for name in solutions.__all__), item.name
        assert not item.check(notebook_function(item.stub) if "def " in item.stub else None).passed


def test_hidden_solutions_leave_the_chapter_12_checkers_running(monkeypatch):
    """A graded lab: solutions.py gone, the chapter imported afresh; no answer is importable, every checker checks."""
    import importlib
    import sys

    import parallel_lib.exercises as package
    from parallel_lib.exercises._core import HIDDEN
    modules = ["ch12", "ch12_dispatch"]
    monkeypatch.setitem(sys.modules, "parallel_lib.exercises.solutions", None)  # import now fails, as when deleted
    for name in modules:
        monkeypatch.delitem(sys.modules, f"parallel_lib.exercises.{name}")
        monkeypatch.delattr(package, name, raising=False)
    fresh = importlib.import_module("parallel_lib.exercises.ch12")
    assert all(item.solution is HIDDEN for item in fresh.EXERCISES)
    assert "not sorted by expert" in fresh.check_dispatch_rows(_dispatch(order="torch.arange(len(token))")).message
    assert fresh.check_balance_effect(dict(no_capacity="busiest", capacity="total")).passed
    assert "every row got its token's first weight" in fresh.check_combine_rows(
        _combine(_COMBINE_RIGHT.replace("weights[token, slot]", "weights[token, 0]"))).message
    # the one launch of this file: the reference written in a cell, in one process and then inside a real
    # expert-parallel forward and backward on 2 gloo ranks (test_exercises runs solutions.py's on ranks too)
    result = fresh.check_dispatch_rows(_dispatch())
    assert result.passed and "on 2 gloo ranks" in result.message, result.message


def test_grade_notebook_scores_the_chapter_12_stubs_zero():
    from parallel_lib.exercises import grade_notebook
    grades = grade_notebook("notebooks/12_mixture_of_experts.ipynb")
    assert [r.exercise for r in grades] == ["dispatch_rows", "combine_rows", "balance_effect"]
    assert not any(r.passed for r in grades) and "score: 0 / 3" in repr(grades)
