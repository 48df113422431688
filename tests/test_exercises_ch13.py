"""Chapter 13's exercises: each checker names each typical wrong answer; the stubs, the graded lab, the notebook.

Wrong answers are written as a student writes them in a cell (``notebook_function``). The reference answers
passing is ``test_exercises.test_reference_solution_passes``; here, the stubs and the graded lab.
"""

import pytest

from parallel_lib import exercises
from parallel_lib.exercises import EXERCISES
from test_exercises import notebook_function  # the same module pytest collects: one counter of cell names

_SLOT = '''
def block_slot(table, block_size, position):
    return {body}
'''


@pytest.mark.parametrize("body, fragments", [
    ("position", ["block_slot([5, 2], 4, 0)", "expected slot 20, got 0", "no table lookup",
                  "not its number in the pool"]),
    ("position // block_size * block_size + position % block_size", ["no table lookup"]),
    ("table[position // block_size]", ["the block, not the slot", "then the offset"]),
    ("table[position // block_size] + position % block_size", ["not scaled to slots", "b * block_size"]),
    ("table[position // block_size + 1] * block_size + position % block_size", ["got 8 (one block too far)",
                                                                                "count from 0"]),
    ("table[position % block_size] * block_size + position // block_size", ["raised IndexError",
                                                                            "the offset is what is left"]),
], ids=["position", "no-lookup", "block-only", "unscaled", "one-block-off", "swapped"])
def test_block_slot_names_each_wrong_answer(body, fragments):
    result = exercises.check_block_slot(notebook_function(_SLOT.format(body=body)))
    assert not result.passed and result.message.startswith("❌ block_slot")
    for fragment in fragments:
        assert fragment in result.message, result.message


def test_block_slot_right_on_small_tables_but_wrong_in_the_engine_is_caught_by_the_gathered_keys():
    sly = notebook_function(_SLOT.format(body="position if len(table) == 4 and block_size == 4 else "
                                              "table[position // block_size] * block_size + position % block_size"))
    result = exercises.check_block_slot(sly)
    assert not result.passed, result.message
    for fragment in ["the engine after 9 steps, request 2 (table [5, 4, 3, 2]", "are not the keys of its tokens",
                     "(the engine reads slots [20, 21, 22, 23, 16"]:
        assert fragment in result.message, result.message


_ADMIT = '''
def admit_requests(free_blocks, waiting, running, max_batch, block_size):
    admitted = []
    for i, length in enumerate(waiting):
        if {full}:
            break
        need = {need}
        if {fits}:
            admitted.append(i)
            free_blocks -= {taken}
        else:
            {blocked}
    return admitted
'''
_ADMIT_RIGHT = dict(full="running + len(admitted) >= max_batch", need="-(-length // block_size)",
                    fits="need <= free_blocks", taken="need", blocked="break")


@pytest.mark.parametrize("change, fragments", [
    (dict(blocked="continue"), ["admit_requests(3, [13, 2], 0, 4, 4)", "you admitted [1]", "blocked head",
                                "no younger one may overtake"]),
    (dict(full="len(admitted) >= max_batch"), ["not counted in max_batch"]),
    (dict(full="running + len(admitted) > max_batch"), ["one sequence more than max_batch"]),
    (dict(need="length // block_size"), ["floor division", "round the division up"]),
    (dict(taken="0"), ["free blocks never decrease"]),
    (dict(fits="need < free_blocks"), ["fits exactly is refused"]),
], ids=["skip-head", "running-ignored", "max-batch-plus-one", "floor", "no-subtract", "strict"])
def test_admit_requests_names_each_wrong_answer(change, fragments):
    result = exercises.check_admit_requests(notebook_function(_ADMIT.format(**{**_ADMIT_RIGHT, **change})))
    assert not result.passed and result.message.startswith("❌ admit_requests")
    for fragment in fragments:
        assert fragment in result.message, result.message


_ACCEPT = '''
import torch

def accept_draft(p, q, token, u):
    if {test}:
        return True, None
    r = {residual}
    return False, r
'''
_ACCEPT_RIGHT = dict(test="u < min(1.0, float(p[token] / q[token]))",
                     residual="(p - q).clamp(min=0) / (p - q).clamp(min=0).sum()")


@pytest.mark.parametrize("change, fragments", [
    (dict(test="u < float(q[token] / p[token])"), ["accepted with probability q/p", "upside down"]),
    (dict(test="bool(p[token] >= q[token])"), ["u not used", "kept sometimes"]),
    (dict(test="u < float(p[token])"), ["q not used"]),
    (dict(residual="p"), ["rejected: expected to resample from", "(resampled from p)", "beyond q"]),
    (dict(residual="(p - q).clamp(min=0)"), ["not normalised", "sums to 1"]),
    (dict(residual="(q - p).clamp(min=0) / (q - p).clamp(min=0).sum()"), ["max(0, q - p)"]),
], ids=["inverted", "no-u", "no-q", "from-p", "unnormalised", "swapped"])
def test_accept_draft_names_each_wrong_answer(change, fragments):
    result = exercises.check_accept_draft(notebook_function(_ACCEPT.format(**{**_ACCEPT_RIGHT, **change})))
    assert not result.passed and result.message.startswith("❌ accept_draft")
    for fragment in fragments:
        assert fragment in result.message, result.message


def test_the_admission_situations_come_from_the_scheduler():
    from parallel_lib.exercises.ch13 import scheduler_admits
    assert scheduler_admits(3, [13, 2], 0, 4, 4) == []              # the head needs 4 blocks: nobody passes it
    assert scheduler_admits(20, [1, 1, 1, 1], 2, 4, 4) == [0, 1]     # 2 running + 2 admitted = max_batch
    assert scheduler_admits(3, [12, 1], 0, 4, 4) == [0]              # 12 tokens take exactly the 3 free blocks


def test_chapter_13_registry_stubs_and_hidden_solutions(monkeypatch):
    """A graded lab: solutions.py gone, the chapter imported afresh; no answer is importable, every checker checks."""
    import importlib
    import sys

    import parallel_lib.exercises as package
    from parallel_lib.exercises import solutions
    from parallel_lib.exercises._core import HIDDEN
    items = {item.name: item for item in EXERCISES["13"]}
    assert list(items) == ["block_slot", "admit_requests", "accept_draft"]
    for item in items.values():
        assert any(getattr(solutions, name) is item.solution for name in solutions.__all__), item.name
        assert "not written yet" in item.check(notebook_function(item.stub)).message
    monkeypatch.setitem(sys.modules, "parallel_lib.exercises.solutions", None)  # import now fails, as when deleted
    for name in ("ch13", "ch13_block_table"):
        monkeypatch.delitem(sys.modules, f"parallel_lib.exercises.{name}")
        monkeypatch.delattr(package, name, raising=False)
    fresh = importlib.import_module("parallel_lib.exercises.ch13")
    assert all(item.solution is HIDDEN for item in fresh.EXERCISES)
    assert fresh.check_admit_requests(notebook_function(_ADMIT.format(**_ADMIT_RIGHT))).passed
    assert fresh.check_accept_draft(notebook_function(_ACCEPT.format(**_ACCEPT_RIGHT))).passed


def test_grade_notebook_scores_the_chapter_13_stubs_zero():
    from parallel_lib.exercises import grade_notebook
    grades = grade_notebook("notebooks/13_serving_engine.ipynb")
    assert [r.exercise for r in grades] == ["block_slot", "admit_requests", "accept_draft"]
    assert not any(r.passed for r in grades) and "score: 0 / 3" in repr(grades)
