"""Exercises for chapter 10b: diagnose the planted bugs of :mod:`.bug_lab` from what the layouts do.

For each bug the student runs ``hunt("B")`` (:mod:`.bug_hunt`: the bug planted in two ranks, seven
layouts against one process), reads which layouts break and how, then names the library function
whose line is wrong and the layouts it breaks::

    dict(where="parallel_lib.some.module.function", breaks=["tp2, m=2", ...])

``where`` may also be the function itself, or any dotted tail of its name that keeps the class
(``"ZeroEngine.reduce_gradients"``). The checker compares ``where`` with the function the bug's
patch makes wrong and ``breaks`` with the bug's rule over the lab's layouts (tests/test_bug_lab.py
proves each rule by running every bug on every layout), so it needs no answer key; a function
students typically blame instead gets a hint of its own. The reference answers are in ``solutions.py``.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping, Sequence

from parallel_lib.exercises._core import CheckResult, Exercise, failed, passed, show, solution
from parallel_lib.exercises.bug_hunt import LAB_LAYOUTS, layout_label
from parallel_lib.exercises.bug_lab import BUGS, Bug, qualified_name

__all__ = ["check_diagnosis", "check_bug_hunt_1", "check_bug_hunt_2", "check_bug_hunt_3", "EXERCISES", "GROUPS",
           "expected_breaks"]

GROUPS = {"bug_hunt_1": ("B", "C"), "bug_hunt_2": ("D", "E", "F"), "bug_hunt_3": ("G", "H")}
LABELS = [layout_label(plan) for plan in LAB_LAYOUTS]


def expected_breaks(bug: Bug) -> set[str]:
    """The labels of the lab's layouts that ``bug`` breaks, by its rule."""
    return {layout_label(plan) for plan in LAB_LAYOUTS if bug.breaks(plan)}


def _where(value: Any) -> str:
    """A dotted name from a string or a function (through ``functools.wraps``); TypeError otherwise."""
    if isinstance(value, str):
        return value.strip().removesuffix("()").strip()
    if callable(value) and hasattr(value, "__qualname__"):
        return qualified_name(inspect.unwrap(value))
    raise TypeError("a function or its dotted name, e.g. \"parallel_lib.training.run.train\"")


def _names(where: str, fn: Any) -> bool:
    """``where`` is ``fn``'s qualified name or a dotted tail of it that keeps the whole ``__qualname__``."""
    full = qualified_name(fn)
    return where == full or (full.endswith("." + where) and where.endswith(fn.__qualname__))


def _labels(value: Any) -> set[str]:
    """A set of the lab's layout labels (case and spaces forgiven); TypeError/ValueError otherwise."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"a list of layout labels as the table prints them, e.g. [{LABELS[0]!r}]")
    canonical = {" ".join(label.lower().split()): label for label in LABELS}
    out = set()
    for item in value:
        key = " ".join(str(item).lower().split())
        if key not in canonical:
            raise ValueError(f"{item!r} is not one of the lab's layouts {LABELS}")
        out.add(canonical[key])
    return out


def _diagnose(bug: Bug, diagnosis: Any) -> tuple[bool, str, str]:
    """(right, what is wrong, hint) for one bug's diagnosis."""
    if not isinstance(diagnosis, Mapping) or not {"where", "breaks"} <= set(diagnosis):
        got = show(diagnosis, 80)
        return False, f"bug {bug.id}: the diagnosis must be dict(where=..., breaks=[...]), got {got}", ""
    try:
        where = _where(diagnosis["where"])
    except TypeError as error:
        return False, f"bug {bug.id}: where must be {error}", ""
    try:
        breaks = _labels(diagnosis["breaks"])
    except (TypeError, ValueError) as error:
        return False, f"bug {bug.id}: breaks must be {error}", ""
    want = expected_breaks(bug)
    if breaks != want:
        missing, extra = sorted(want - breaks), sorted(breaks - want)
        parts = ([f"{missing} break too" if missing else ""] + [f"{extra} do not break" if extra else ""])
        return False, f"bug {bug.id}: {'; '.join(p for p in parts if p)}", \
            f"run hunt({bug.id!r}) and read the result column: a crash breaks a layout too"
    if not _names(where, bug.culprit):
        culprit = bug.culprit
        if where == culprit.__name__ and culprit.__qualname__ != culprit.__name__:
            return False, f"bug {bug.id}: name the class too", f"write {where!r} as Class.{where}"
        for decoy, hint in bug.decoys.items():
            if where == decoy or decoy.endswith("." + where):
                return False, f"bug {bug.id}: the wrong line is not in {where}", hint
        return False, f"bug {bug.id}: the wrong line is not in {where}", bug.clue
    return True, "", ""


def check_diagnosis(bug: str, diagnosis: Any) -> CheckResult:
    """One bug's diagnosis, ``dict(where=..., breaks=[...])``, against the planted bug.

    Raises:
        ValueError: an unknown bug id.
    """
    if bug not in BUGS:
        raise ValueError(f"bug must be one of {sorted(BUGS)}, got bug={bug!r}")
    name = f"bug_{bug}"
    if diagnosis is None or diagnosis is Ellipsis:
        return failed(name, None, f"the diagnosis of bug {bug} is not answered yet (it is still {diagnosis!r})")
    right, problem, hint = _diagnose(BUGS[bug], diagnosis)
    if not right:
        return failed(name, None, problem, hint)
    return passed(name, f"bug {bug} is in {BUGS[bug].where}: {BUGS[bug].wrong_line}")


def _check_group(name: str, answer: Any) -> CheckResult:
    ids = GROUPS[name]
    if answer is None or answer is Ellipsis or (isinstance(answer, Mapping) and all(answer.get(b) is None
                                                                                   for b in ids)):
        return failed(name, None, f"the diagnoses of bugs {', '.join(ids)} are not answered yet (still None)")
    if not isinstance(answer, Mapping):
        return failed(name, None, f"the answer must be a dict {{bug: dict(where=..., breaks=[...])}} for bugs "
                      f"{', '.join(ids)}, got {show(answer, 80)}")
    for bug in ids:
        if answer.get(bug) is None:
            return failed(name, None, f"bug {bug} is not answered yet (still None)")
        right, problem, hint = _diagnose(BUGS[bug], answer[bug])
        if not right:
            return failed(name, None, problem, hint)
    return passed(name, f"{len(ids)} bugs: " + "; ".join(f"{b} in {BUGS[b].culprit.__qualname__}" for b in ids))


def check_bug_hunt_1(answer: Any) -> CheckResult:
    """Bugs B and C: where the wrong line is and which layouts break."""
    return _check_group("bug_hunt_1", answer)


def check_bug_hunt_2(answer: Any) -> CheckResult:
    """Bugs D, E and F: where the wrong line is and which layouts break."""
    return _check_group("bug_hunt_2", answer)


def check_bug_hunt_3(answer: Any) -> CheckResult:
    """Bugs G and H: where the wrong line is and which layouts break."""
    return _check_group("bug_hunt_3", answer)


def _stub(name: str, ids: Sequence[str]) -> str:
    lines = [f"# Bugs {' and '.join(ids) if len(ids) == 2 else ', '.join(ids[:-1]) + ' and ' + ids[-1]}. For each: "
             f"print(hunt({ids[0]!r})) runs the 7 layouts with the bug",
             "# planted (one launch of 2 ranks, a few seconds); read which layouts break and how (a crash? the first",
             "# loss already wrong?), then read the code that only those layouts run (inspect.getsource) and name the",
             "# function whose line is wrong, as \"module.function\" (or \"module.Class.method\", or the function).",
             f"{name.upper()} = {{"]
    lines += [f"    {b!r}: None,  # dict(where=\"parallel_lib....\", breaks=[\"layout\", ...])" for b in ids]
    return "\n".join(lines + ["}", ""])


_CHECKS = {"bug_hunt_1": check_bug_hunt_1, "bug_hunt_2": check_bug_hunt_2, "bug_hunt_3": check_bug_hunt_3}
EXERCISES = [
    Exercise(name, _CHECKS[name], _stub(name, ids), solution(name.upper()),
             f"Find bugs {' and '.join(ids) if len(ids) == 2 else ', '.join(ids[:-1]) + ' and ' + ids[-1]}: which "
             "layouts break, and which function's line is wrong?")
    for name, ids in GROUPS.items()]
