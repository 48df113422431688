"""Chapter 13's exercises: each checker passes the reference and names each typical wrong answer; and the widget's
replay of the engine's records (the state of every request in every step, the owners of every block).

Wrong answers are written as a student writes them in a cell (``notebook_function``). The reference answers
passing is ``test_exercises.test_reference_solution_passes``; here, the stubs and the graded lab.
"""

from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from parallel_lib import exercises  # noqa: E402
from parallel_lib.exercises import EXERCISES  # noqa: E402
from test_exercises import notebook_function  # noqa: E402  the same module pytest collects: one cell counter

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
    (dict(test="u < float(q[token] / p[token])"), ["accepted with probability q/p", "min(1, p(x) / q(x))"]),
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


# --- the widget's replay -------------------------------------------------------------------------------------

def _record(step, prefill=(), decode=(), admitted=(), preempted=(), finished=(), tables=None, fed=None, free=0):
    return SimpleNamespace(step=step, prefill=list(prefill), decode=list(decode), admitted=list(admitted),
                           preempted=list(preempted), finished=list(finished), tables=tables or {}, fed=fed or {},
                           free_blocks=free, lengths={})


# two requests in a pool of 3 blocks of 2: r0 grows into a second block, r1 is preempted, r0 ends, r1 returns
_RECORDS = [_record(0, prefill=[0, 1], admitted=[0, 1], tables={0: [0], 1: [1]}, fed={0: 2, 1: 1}, free=1),
            _record(1, decode=[0], preempted=[1], tables={0: [0, 2]}, free=1),
            _record(2, decode=[0], finished=[0], tables={0: [0, 2]}, free=1),
            _record(3, prefill=[1], admitted=[1], tables={1: [2, 0]}, fed={1: 2}, free=1)]


def test_the_replay_reads_each_requests_state_and_each_blocks_owner_from_the_records():
    from parallel_lib.viz.serving_steps import block_owners, serving_step_caption, step_states
    assert step_states(_RECORDS) == {0: ["prefill", "decode", "finished", ""],
                                     1: ["prefill", "preempted", "", "prefill"]}
    assert block_owners(_RECORDS[1], 3) == [[(0, 0)], [], [(0, 1)]]
    assert block_owners(_RECORDS[3], 3) == [[(1, 1)], [], [(1, 0)]]                  # a table out of order
    shared = _record(0, tables={0: [0, 1], 1: [0, 2]})
    assert block_owners(shared, 3)[0] == [(0, 0), (1, 0)]                            # a prefix block, held twice
    assert serving_step_caption(_RECORDS, 1) == ("step 1: prefill none; decode r0; admitted none; preempted r1; "
                                                 "finished none; 1 blocks free")
    assert "prefill r0 (2 tokens), r1 (1 token)" in serving_step_caption(_RECORDS, 0)
    with pytest.raises(ValueError, match="outside a pool of num_blocks=2"):
        block_owners(_RECORDS[1], 2)
    with pytest.raises(ValueError, match="step"):
        serving_step_caption(_RECORDS, 4)
    with pytest.raises(ValueError, match="records must hold"):
        serving_step_caption([], 0)


def test_a_frame_writes_each_blocks_owner_and_the_strip_draws_the_steps_asked_for():
    from parallel_lib.viz.serving_steps import render_serving_step, render_serving_strip
    fig = render_serving_step(_RECORDS, 3, 3)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert [t for t in texts if t.startswith("r") or t == "free"] == ["r1 #1", "free", "r1 #0"]
    plt.close(fig)
    fig = render_serving_strip(_RECORDS, 3, steps=[0, 1])
    assert len(fig.axes) == 3 and fig.axes[1].get_title(loc="left").startswith("step 1: ")
    plt.close(fig)
