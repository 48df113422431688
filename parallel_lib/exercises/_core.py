"""What every exercise checker shares: run the cases, compare, report kindly.

A checker is run by a student, over and over, on an answer that is not finished yet.
So it never raises on a wrong answer (a traceback reads as "the checker is broken");
it returns a :class:`CheckResult` whose repr is one clear message, which a notebook
cell shows as its output:

    ✅ clock_cycles: passed 7 cases
    ❌ clock_cycles, case _clock_cycles(4, 2): tick 4: expected [(3, 1)], got []
       hint: micro-batch i reaches partition j at tick k = i + j

Exceptions raised by the student's code are caught and reported with the case that
raised them; a stub whose body is still ``...`` is recognised before it runs.
Only a non-callable where a function is required is a caller's error (TypeError).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import itertools
import math
import textwrap
from dataclasses import dataclass
from numbers import Real
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

__all__ = ["CheckResult", "Exercise", "Case", "HIDDEN", "solution", "check_function", "check_value", "require_callable",
           "is_stub",
           "passed", "failed", "stub_result", "as_int", "as_number", "same_number", "close", "distinct", "show",
           "REL_TOL"]

# compares an expected value with the student's (normalised) one: None if they agree,
# otherwise the sentence that says what differs ("tick 4: expected ..., got ...")
Compare = Callable[[Any, Any], Optional[str]]
Hint = Callable[[tuple, Any], str]  # (case arguments, the student's answer) -> "" or a hint
_MAX_ITEMS = 10_000  # items taken from a returned generator, so that an endless one still ends


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one check; a notebook cell displays it as its ``message``.

    Attributes:
        exercise: the exercise's name, e.g. "clock_cycles".
        passed: True when every case agreed with the reference.
        message: "✅ ..." or "❌ <case>: ...", possibly followed by a hint line.
        failing_case: the first case that failed, e.g. "_clock_cycles(4, 2)"; None when passed.
    """

    exercise: str
    passed: bool
    message: str
    failing_case: Optional[str] = None

    def __repr__(self) -> str:
        return self.message

    __str__ = __repr__

    def __bool__(self) -> bool:  # so that ``assert check_x(answer)`` reads naturally
        return self.passed


class Exercise(NamedTuple):
    """One classroom exercise: its checker, the stub cell a student fills in, a reference answer."""

    name: str
    check: Callable[[Any], CheckResult]
    stub: str       # source of the stub cell; defines the answer under ``answer_name``
    solution: Any   # a reference function, or the value, that passes ``check`` (HIDDEN in a graded lab)
    title: str = ""  # the task in whole sentences: the notebook's heading of the exercise

    @property
    def answer_name(self) -> str:
        """The name the stub cell defines (the function or the variable the student fills in)."""
        for node in ast.parse(self.stub).body:
            if isinstance(node, ast.FunctionDef):
                return node.name
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
                return node.targets[0].id
        raise ValueError(f"the stub of exercise {self.name!r} defines no function or variable")

    @property
    def check_source(self) -> str:
        """Source of the check cell that goes below the stub cell."""
        return (f"from parallel_lib.exercises import {self.check.__name__}\n\n"
                f"{self.check.__name__}({self.answer_name})")


class _Hidden:
    def __repr__(self) -> str:
        return "HIDDEN (solutions.py was removed for a graded lab)"


HIDDEN = _Hidden()


def solution(name: str) -> Any:
    """The reference answer ``name`` from ``solutions.py``, or :data:`HIDDEN` once a teacher removed it.

    Checkers never need the solutions (they compare with the library), so a graded lab can ship
    without the file (``python -m parallel_lib.exercises hide-solutions``) and every check still runs.
    """
    try:
        module = importlib.import_module("parallel_lib.exercises.solutions")
    except ModuleNotFoundError:
        return HIDDEN
    return getattr(module, name)


@dataclass(frozen=True)
class Case:
    """One call to check: ``fn(*args)`` must return ``expected`` (or raise it, if an exception class)."""

    args: tuple
    expected: Any


def passed(exercise: str, what: str) -> CheckResult:
    return CheckResult(exercise, True, f"✅ {exercise}: passed {what}")


def failed(exercise: str, case: Optional[str], problem: str, hint: str = "") -> CheckResult:
    where = f"{exercise}, case {case}" if case else exercise
    message = f"❌ {where}: {problem}" + (f"\n   hint: {hint}" if hint else "")
    return CheckResult(exercise, False, message, case)


def call_student(exercise: str, case: str, fn: Callable, args: tuple, convert: Callable[[Any], Any],
                 what: str) -> tuple[Any, Optional[CheckResult]]:
    """One case of a student's function: ``(answer, None)``, or ``(None, the failed result)`` when it raised,
    returned None, or returned what ``convert`` refuses (its TypeError says what ``what`` must be).

    Test the second with ``is not None``: a failed :class:`CheckResult` is falsy."""
    try:
        got = fn(*args)
    except Exception as error:  # noqa: BLE001 - the student's code, reported with its case
        return None, failed(exercise, case, f"raised {type(error).__name__}: {error}")
    if got is None:
        return None, failed(exercise, case, "returned None: the function is not written yet, or it forgets to `return`")
    try:
        return convert(got), None
    except TypeError as error:
        return None, failed(exercise, case, f"returned {show(got, 80)}, but {what} must be {error}")


def show(value: Any, limit: int = 300) -> str:
    """``repr`` cut to ``limit`` characters, floats rounded so messages stay readable."""
    if isinstance(value, float):
        text = f"{value:.6g}"
    elif isinstance(value, (list, tuple)) and value and all(isinstance(v, float) for v in value):
        text = "[" + ", ".join(f"{v:.6g}" for v in value) + "]"
    else:
        text = repr(value)
    return text if len(text) <= limit else text[:limit - 5] + " ...]"


def require_callable(fn: Any, name: str) -> None:
    """The only error a checker raises: it was handed something that cannot be called."""
    if not callable(fn):
        raise TypeError(f"pass the function itself ({name}, not {name}(...)); "
                        f"got a {type(fn).__name__}: {show(fn, 80)}")


def is_stub(fn: Callable) -> bool:
    """True if ``fn``'s body is still only a docstring, ``...`` or ``pass`` (as in a stub cell)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):  # built-ins, lambdas in odd places, exec'd code
        return False
    definition = tree.body[0] if tree.body else None
    if not isinstance(definition, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    return all(isinstance(stmt, ast.Pass) or (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
                                              and (stmt.value.value is Ellipsis or isinstance(stmt.value.value, str)))
               for stmt in definition.body)


def stub_result(exercise: str, name: str) -> CheckResult:
    return failed(exercise, None, f"{name} is still the stub: the function is not written yet "
                  "(replace `...` with your code)")


def as_number(value: Any) -> float:
    """A real number (int, float, NumPy or 0-d torch scalar) as float; TypeError otherwise."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"a number, not a {type(value).__name__} ({show(value, 80)})")
    return float(value)


def as_int(value: Any) -> int:
    """A whole number as int; TypeError for floats such as 32.0 (a count is never a float)."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"an int, not a {type(value).__name__} ({show(value, 80)}); use // for whole numbers")
    return value


# Answers may be computed in float32 (a torch tensor's default dtype): its 24-bit mantissa
# carries about 7 significant digits, and a few operations lose a few units in the last place.
# One part in a million accepts those and still rejects every formula mistake the hints name.
REL_TOL, ABS_TOL = 1e-6, 1e-9


def close(expected: float, got: float) -> bool:
    """True when ``got`` equals ``expected`` up to float32 rounding (see ``REL_TOL``)."""
    return math.isclose(expected, got, rel_tol=REL_TOL, abs_tol=ABS_TOL)


def same_number(expected: float, got: float) -> Optional[str]:
    if close(expected, got):
        return None
    return f"expected {', got '.join(distinct(expected, got))}"


def distinct(expected: float, got: float) -> tuple[str, str]:
    """Both numbers with as few digits as tell them apart (6 at least, 17 at most)."""
    for digits in range(6, 18):
        a, b = f"{expected:.{digits}g}", f"{got:.{digits}g}"
        if a != b:
            return a, b
    return repr(expected), repr(got)


def _equal(expected: Any, got: Any) -> Optional[str]:
    return None if got == expected else f"expected {show(expected)}, got {show(got)}"


def _is_exception(expected: Any) -> bool:
    return isinstance(expected, type) and issubclass(expected, BaseException)


def check_function(exercise: str, fn: Any, name: str, cases: Sequence[Case], *,
                   normalise: Optional[Callable[[Any], Any]] = None, compare: Compare = _equal,
                   hint: Optional[Hint] = None, none_is_an_answer: bool = False) -> CheckResult:
    """Call ``fn`` on every case and report the first disagreement with the reference.

    Args:
        exercise: the exercise's name, for the message.
        fn: the student's function.
        name: the function's name in the stub, to write cases as calls ("_clock_cycles(4, 2)").
        cases: the calls to make, easy ones first: the first failure is the one reported.
        normalise: turns the student's return value into the reference's form (a generator
            into lists, a tensor into numbers); raises TypeError/ValueError, with what was
            expected, when the value has the wrong form.
        compare: ``compare(expected, got)`` is None when they agree, else what differs.
        hint: ``hint(args, got)`` adds a line that guesses the mistake (may return ""); ``got``
            is normalised, except for an answer where the case expects an exception.
        none_is_an_answer: None is a possible answer ("it does not fit"), compared like any
            other, instead of meaning "not written yet".

    Raises:
        TypeError: ``fn`` is not callable.
    """
    require_callable(fn, name)
    if is_stub(fn):
        return stub_result(exercise, name)
    for case in cases:
        label = f"{name}({', '.join(map(repr, case.args))})"
        try:
            got = fn(*case.args)
            if isinstance(got, Iterator):  # run a generator's body here, where its errors are caught
                got = list(itertools.islice(got, _MAX_ITEMS))
        except Exception as error:  # the student's bug, reported with its case; Ctrl-C still stops
            if _is_exception(case.expected) and isinstance(error, case.expected):
                continue
            return failed(exercise, label, f"raised {type(error).__name__}: {error}")
        if _is_exception(case.expected):
            return failed(exercise, label, f"expected a {case.expected.__name__} to be raised, got {show(got)}",
                          hint(case.args, got) if hint else "")
        if got is None and not none_is_an_answer:
            return failed(exercise, label, "returned None: the function is not written yet, "
                          "or it forgets to `return` its answer")
        try:
            got = normalise(got) if normalise and got is not None else got
        except (TypeError, ValueError) as error:
            return failed(exercise, label, f"returned {show(got, 120)}, but the answer must be {error}")
        difference = compare(case.expected, got)
        if difference is not None:
            return failed(exercise, label, difference, hint(case.args, got) if hint else "")
    return passed(exercise, f"{len(cases)} cases")


def check_value(exercise: str, answer: Any, name: str, expected: Any, *,
                normalise: Optional[Callable[[Any], Any]] = None, compare: Compare = _equal,
                hint: Optional[Callable[[Any], str]] = None) -> CheckResult:
    """Check a predicted value (a variable the student sets) against the reference."""
    if answer is None or answer is Ellipsis:
        return failed(exercise, None, f"{name} is not answered yet (it is still {answer!r})")
    try:
        got = normalise(answer) if normalise else answer
    except (TypeError, ValueError) as error:
        return failed(exercise, None, f"{name} = {show(answer, 120)}, but the answer must be {error}")
    difference = compare(expected, got)
    if difference is not None:
        return failed(exercise, None, difference, hint(got) if hint else "")
    return passed(exercise, "1 case")
