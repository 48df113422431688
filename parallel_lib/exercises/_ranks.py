"""Run a student's notebook function on real gloo ranks and turn every way it can fail into a message.

The exercises that write distributed code (chapter 02's averaging and bucketing, 07's f, g and loss)
check it where it runs: the checker ships the student's cell to ``world_size`` gloo ranks (``_shipping``), each rank
runs a worker of the checker's that calls it on every case and returns what it observed, and
the checker compares in the notebook's process. What can go wrong before there is anything to
compare is the same for every such checker, so it is said here once:

- the cell calls the library's own answer (``parallel_lib.tensor_parallel...``): that passes
  without writing anything, so it is refused before any rank starts;
- the source cannot be read (a lambda), the ranks do not start (a busy machine), a rank waits
  in a collective the others never call (the run's timeout), or a rank raises (its case and
  error, with the checker's hint for the error).

A worker raises ``RuntimeError(f"case {label!r}: {error}")`` so that the failing case is named.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence, Union

from parallel_lib.exercises._core import CheckResult, failed
from parallel_lib.exercises._shipping import ShippedFunction, ship
from parallel_lib.runtime.launcher import LaunchTimeoutError, RankError, launch

__all__ = ["SAME_CALLS", "uses_the_library", "run_on_ranks", "case_error"]

SAME_CALLS = ("every rank must make the same collective calls, in the same order, with tensors of the same "
              "shape; a rank that skips one leaves the others waiting")
_CASE = re.compile(r"RuntimeError: case ('.*?'): (.*)")


def case_error(label: str, error: Exception) -> RuntimeError:
    """The error a rank worker raises when the student's code raised in case ``label``."""
    return RuntimeError(f"case {label!r}: {type(error).__name__}: {error}")


def uses_the_library(shipped: ShippedFunction) -> bool:
    """True when the shipped function reaches into ``parallel_lib`` (by module, value or source) outside the
    exercises package (whose ``solutions`` a student may import and check, by reference)."""
    def library(module: str) -> bool:
        return module.split(".")[0] == "parallel_lib" and not module.startswith("parallel_lib.exercises")

    if shipped.function is not None:
        return library(getattr(shipped.function, "__module__", "") or "")
    return (re.search(r"parallel_lib(?!\.exercises)", shipped.source) is not None
            or any(library(m) for m in shipped.modules.values())
            or any(library(getattr(v, "__module__", "") or "") for v in shipped.objects.values()))


def run_on_ranks(exercise: str, fn: Union[Callable, Sequence[Callable]], worker: Callable[..., Any], world_size: int,
                 *args: Any,
                 timeout: float = 30.0, crash_hint: Callable[[str], str] = lambda message: "",
                 same_calls: str = SAME_CALLS, allow_library: bool = False) -> Union[list[Any], CheckResult]:
    """``launch(worker, world_size, ship(fn), *args)`` on gloo ranks: every rank's result, or the failure.

    Args:
        exercise: the exercise's name, for the messages.
        fn: the student's function (already known to be callable and not a stub), or a list of answers
            to check in one launch (a test's wrong answers): the worker then gets a tuple of shipped functions.
        worker: ``worker(rank, world_size, shipped, *args)``, defined in an importable module.
        timeout: seconds for the run once the ranks have started (and each collective's limit).
        crash_hint: turns the last line of a rank's traceback into a hint ("" for none).
        same_calls: the hint when ranks wait for each other (a timeout, or a rank failing after others returned).
        allow_library: accept a function that calls ``parallel_lib`` (the reference answers do not).

    Returns:
        The list of the ranks' return values, or a failed :class:`CheckResult` saying what went wrong.
    """
    several = isinstance(fn, (list, tuple))
    try:
        answers = tuple(ship(f) for f in (fn if several else [fn]))
    except ValueError as error:  # the source could not be read
        return failed(exercise, None, str(error))
    if not allow_library and any(uses_the_library(shipped) for shipped in answers):
        return failed(exercise, None, "the answer calls parallel_lib, the library whose code this exercise asks "
                      "you to write", "write it with torch and torch.distributed only")
    try:
        return launch(worker, world_size, answers if several else answers[0], *args, backend="gloo", timeout=timeout,
                      threads_per_rank=1)
    except LaunchTimeoutError as error:
        if error.phase == "start-up":  # the machine is busy: not the student's mistake
            return failed(exercise, None, str(error).splitlines()[0], "run the check again when the machine is quieter")
        return failed(exercise, None, f"the {world_size} ranks did not finish within {timeout:g} s", same_calls)
    except RankError as error:
        last = error.traceback_text.strip().splitlines()[-1] if error.traceback_text else str(error)
        match = _CASE.fullmatch(last)
        case, crash = match.groups() if match else (None, last)
        hint = same_calls if error.returned else crash_hint(crash)
        return failed(exercise, case, f"rank {error.ranks[0]} raised {crash}", hint)

