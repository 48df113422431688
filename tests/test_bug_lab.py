"""Chapter 10b's bug lab: every planted bug is caught by the layout check, breaking exactly the layouts its
rule names (and crashing or getting the first loss wrong where it says), the checker accepts the right
diagnosis and rejects wrong ones, and planting leaves nothing behind, also when the block raises.

One launch of 2 ranks runs every bug on every layout, then the library with no bug: the last pass
also shows that the ranks took each bug out again.
"""

from __future__ import annotations

import importlib

import pytest

from parallel_lib.exercises import check_diagnosis
from parallel_lib.exercises.bug_hunt import LAB_LAYOUTS, Hunt, hunt_many, layout_label
from parallel_lib.exercises.bug_lab import BUGS, planted, planted_now
from parallel_lib.exercises.ch10b import expected_breaks


@pytest.fixture(scope="module")
def hunted() -> dict:
    return hunt_many([*BUGS, None])


def test_at_least_six_bugs_each_with_a_public_report():
    assert len(BUGS) >= 6
    for bug in BUGS.values():
        assert bug.reports and all("/" in r and "#" in r for r in bug.reports), bug.id


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_each_bug_breaks_exactly_the_layouts_its_rule_names(hunted, bug):
    table, rule = hunted[bug], BUGS[bug]
    assert isinstance(table, Hunt) and [o.label for o in table] == [layout_label(p) for p in LAB_LAYOUTS]
    assert table.broken == expected_breaks(rule), str(table)
    assert 0 < len(table.broken) < len(LAB_LAYOUTS), str(table)  # some layout breaks and some passes: a clue
    for outcome in table:
        if outcome.label not in table.broken:
            continue
        assert (outcome.status == "crashed") == rule.crashes(outcome.plan), str(table)
        if outcome.status == "differs":  # a wrong loss shows in the first step's loss, a wrong backward does not
            assert outcome.first_loss_equal == rule.forward_ok, str(table)
            assert outcome.difference > 100 * 1e-6, str(table)


def test_without_a_bug_every_layout_equals_one_process_after_the_bugs_were_taken_out(hunted):
    table = hunted[None]
    assert table.broken == set(), str(table)
    assert all(o.first_loss_equal and o.difference <= 1e-6 for o in table), str(table)
    # every layout also passed with some other bug planted: the bugs break only what their rule names
    assert {o.label for b in BUGS for o in hunted[b] if o.status == "equal"} == {layout_label(p) for p in LAB_LAYOUTS}


def test_the_distinct_signatures_tell_every_bug_apart(hunted):
    signatures = {bug: tuple((o.status, o.first_loss_equal) for o in hunted[bug]) for bug in BUGS}
    assert len(set(signatures.values())) == len(BUGS), signatures


def _owners(bug):
    return [(patch.owner, patch.name, vars(patch.owner)[patch.name]) for patch in BUGS[bug].patches]


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_planting_is_undone_on_leaving_and_on_error(bug):
    before = _owners(bug)
    with planted(bug) as planted_bug:
        assert planted_bug is BUGS[bug] and planted_now() == [bug]
        assert all(vars(owner)[name] is not original for owner, name, original in before)
    assert _owners(bug) == before and planted_now() == []
    with pytest.raises(RuntimeError, match="inside"):
        with planted(bug):
            raise RuntimeError("raised inside the block")
    assert all(vars(owner)[name] is original for owner, name, original in before) and planted_now() == []


def test_one_bug_at_a_time_and_unknown_bugs_are_refused():
    with planted("A"):
        with pytest.raises(ValueError, match="bug A is planted already: plant one bug at a time"):
            with planted("B"):
                pass
    assert planted_now() == []
    with pytest.raises(ValueError, match=r"bug must be one of \['A'.*got bug='Z'"):
        with planted("Z"):
            pass
    with pytest.raises(ValueError, match="got bug='Z'"):
        hunt_many(["Z"])
    with pytest.raises(ValueError, match="2 ranks"):
        from parallel_lib.training import Plan
        hunt_many(["A"], layouts=[Plan(dp=4)])


def _diagnosis(bug, where=None, breaks=None):
    return dict(where=BUGS[bug].where if where is None else where,
                breaks=sorted(expected_breaks(BUGS[bug])) if breaks is None else breaks)


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_the_right_diagnosis_is_accepted_in_every_form(bug):
    culprit = BUGS[bug].culprit
    for where in (BUGS[bug].where, culprit, culprit.__qualname__, f"{culprit.__module__.split('.')[-1]}."
                  f"{culprit.__qualname__}"):
        result = check_diagnosis(bug, _diagnosis(bug, where))
        assert result.passed, result.message
    shouted = [label.upper().replace(" ", "  ") for label in expected_breaks(BUGS[bug])]
    assert check_diagnosis(bug, _diagnosis(bug, breaks=shouted)).passed


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_wrong_diagnoses_are_rejected_with_a_hint(bug):
    rule = BUGS[bug]
    assert len(rule.decoys) >= 2
    for decoy, hint in rule.decoys.items():  # the functions students blame instead, each with its own hint
        assert callable(_resolve(decoy)), decoy  # every decoy names a real function
        result = check_diagnosis(bug, _diagnosis(bug, decoy))
        assert not result.passed and f"not in {decoy}" in result.message and hint in result.message
    other = next(b for b in sorted(BUGS) if BUGS[b].culprit is not rule.culprit and BUGS[b].where not in rule.decoys)
    result = check_diagnosis(bug, _diagnosis(bug, BUGS[other].where))  # another bug's culprit: the general clue
    assert not result.passed and rule.clue in result.message
    wrong = sorted({layout_label(p) for p in LAB_LAYOUTS} - expected_breaks(rule))[:1]
    result = check_diagnosis(bug, _diagnosis(bug, breaks=sorted(expected_breaks(rule)) + wrong))
    assert not result.passed and f"{wrong} do not break" in result.message
    result = check_diagnosis(bug, _diagnosis(bug, breaks=sorted(expected_breaks(rule))[1:]))
    assert not result.passed and "break too" in result.message


def _resolve(dotted):
    """The object a dotted name names: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(dotted)


@pytest.mark.parametrize("answer, fragment", [
    (None, "not answered yet"),
    (dict(where="x"), "must be dict(where=..., breaks=[...])"),
    (dict(where=3, breaks=[]), "where must be a function or its dotted name"),
    (dict(where="x", breaks="dp2, m=2"), "breaks must be a list of layout labels"),
    (dict(where="x", breaks=["dp3"]), "'dp3' is not one of the lab's layouts"),
    (dict(where="reduce_gradients", breaks=["dp2, m=2", "dp2 zero1, m=1"]), "name the class too"),
])
def test_malformed_diagnoses_say_what_is_expected(answer, fragment):
    result = check_diagnosis("A", answer)
    assert not result.passed and fragment in result.message, result.message
    with pytest.raises(ValueError, match="bug must be one of"):
        check_diagnosis("Z", answer)


def test_the_checkers_run_without_solutions_py(monkeypatch):
    import sys

    from parallel_lib.exercises import check_bug_hunt_1, check_bug_hunt_3
    from parallel_lib.exercises._core import HIDDEN, solution
    monkeypatch.setitem(sys.modules, "parallel_lib.exercises.solutions", None)  # a graded lab: import now fails
    assert solution("BUG_HUNT_1") is HIDDEN
    assert check_bug_hunt_1({b: _diagnosis(b) for b in ("B", "C")}).passed
    result = check_bug_hunt_3({"G": _diagnosis("G"), "H": _diagnosis("H", where=BUGS["G"].where)})
    assert not result.passed and "bug H: the wrong line is not in" in result.message
    assert "not answered yet" in check_bug_hunt_3({"G": None, "H": None}).message
