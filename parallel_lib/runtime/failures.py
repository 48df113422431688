"""Turning what ranks reported (tracebacks, exit codes, signals, silence) into one clear error.

A failure in one rank makes its peers fail soon after ("connection reset by peer" in a
collective), so the error blames the likeliest cause: a rank that died without a Python
exception if there is one, else the earliest traceback. Messages also say what the
symptom usually means in class: SIGABRT from gloo is nearly always ranks that passed
tensors of different sizes to the same collective; a rank that fails in a collective
while others have already returned is nearly always a collective that only some ranks
call.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Sequence

__all__ = ["RankError", "LaunchTimeoutError", "Reports", "failure", "startup_timeout_error", "run_timeout_error",
           "job_error", "exit_reason"]


class RankError(RuntimeError):
    """One or more ranks failed; the message names them and carries the rank's traceback.

    Attributes:
        ranks: the ranks the error is about (the failing one, or those that timed out).
        traceback_text: the traceback formatted inside the failing rank ("" if none).
        exitcode: the process exit code when a rank died without a Python exception.
        returned: ranks that had already returned when the failure happened; non-empty, they
            suggest a collective that only some ranks called.
    """

    def __init__(self, message: str, ranks: Sequence[int], traceback_text: str = "",
                 exitcode: int | None = None, returned: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.traceback_text = traceback_text
        self.exitcode = exitcode
        self.returned = tuple(returned)


class LaunchTimeoutError(RankError):
    """Some ranks had not started, or not finished, when ``launch``'s timeouts ran out.

    Attributes:
        phase: "start-up" (spawn, imports, joining the group: ``startup_timeout``) or "run"
            (``fn`` itself: ``timeout``).
    """

    def __init__(self, message: str, ranks: Sequence[int], phase: str, returned: Sequence[int] = ()) -> None:
        super().__init__(message, ranks, returned=returned)
        self.phase = phase


# what a signal that ends a rank usually means in this course
_SIGNAL_HINTS = {
    "SIGABRT": "gloo aborts a rank when the ranks of one collective pass tensors of different sizes, shapes or "
               "dtypes (the terminal shows \"Received data size doesn't match expected size\"): make every rank "
               "pass tensors of the same shape and dtype to each collective",
    "SIGKILL": "the out-of-memory killer (or a kill -9): use fewer ranks, or a smaller model or batch",
    "SIGSEGV": "a crash in native code (a torch or driver bug, or a tensor freed while in use)",
}
_SAME_CALLS = ("every rank must make the same collective calls, in the same order, with tensors of the same "
               "shape; a collective that only some ranks call fails or waits forever")


@dataclass
class Reports:
    """What the ranks of one launch have reported so far."""

    world_size: int
    results: dict[int, object]
    errors: list[tuple[float, int, str]]   # (time, rank, traceback) of ranks that raised
    deaths: list[tuple[int, int | None]]   # (rank, exit code) of ranks that ended without a word

    def failed(self) -> list[int]:
        return sorted([r for _, r, _ in self.errors] + [r for r, _ in self.deaths])


def exit_reason(exitcode: int | None) -> str:
    """How a rank ended without a Python exception."""
    if exitcode is not None and exitcode < 0:
        return f"was killed by signal {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode}"


def _usual_cause(exitcode: int | None) -> str:
    """What such an end usually means in this course, as a sentence to append."""
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name
        return f"\n{name} here usually means: {_SIGNAL_HINTS[name]}." if name in _SIGNAL_HINTS else ""
    return " (a crash outside Python, os._exit or out of memory?)"


def _returned(reports: Reports) -> str:
    """Why the blamed ranks may be innocent: some ranks had returned while they still waited."""
    returned = sorted(reports.results)
    if not returned:
        return ""
    return f"\nranks {returned} had already returned when this happened: {_SAME_CALLS}."


def failure(reports: Reports) -> RankError:
    """One error for the failures seen together, blaming the likeliest cause."""
    rank = reports.deaths[0][0] if reports.deaths else min(reports.errors)[1]
    others = [r for r in reports.failed() if r != rank]
    also = f" (ranks {others} failed as well, probably in reaction)" if others else ""
    if reports.deaths:
        code = reports.deaths[0][1]
        return RankError(f"rank {rank} of {reports.world_size} {exit_reason(code)} before returning a result{also}"
                         f"{_usual_cause(code)}{_returned(reports)}", [rank], exitcode=code,
                         returned=sorted(reports.results))
    text = min(reports.errors)[2]
    return RankError(f"rank {rank} of {reports.world_size} raised an exception{also}{_returned(reports)}"
                     f"\n{text}", [rank], traceback_text=text, returned=sorted(reports.results))


def job_error(rank: int, world_size: int, text: str, main_names: list[str]) -> RankError:
    """A rank could not unpickle its job: usually an object that exists only in the caller's ``__main__``."""
    if main_names:
        names = ", ".join(repr(name) for name in main_names)
        why = (f"the job refers to {names}, which a spawned rank cannot import (it was defined in a notebook cell, "
               "an interactive session, or under `if __name__ == \"__main__\":`); move it into a module and import "
               "it from there")
    else:
        why = "a module that fn or its arguments come from cannot be imported in a fresh process"
    return RankError(f"rank {rank} of {world_size} could not load the job it was sent: {why}.\n{text}", [rank],
                     traceback_text=text)


def startup_timeout_error(seconds: float, world_size: int, waiting: list[int], started: list[int]
                          ) -> LaunchTimeoutError:
    return LaunchTimeoutError(
        f"start-up timed out after {seconds:g} s: ranks {waiting} of {world_size} had not joined the process group "
        f"(joined: {started}). Start-up is spawning, importing torch and your modules, and the backend's "
        "initialisation; on a busy machine raise startup_timeout=.", waiting, "start-up")


def run_timeout_error(seconds: float, world_size: int, pending: list[int], finished: list[int]) -> LaunchTimeoutError:
    hint = (f" ranks {finished} had already returned: if the others wait in a collective, {_SAME_CALLS}."
            if finished else " A rank may be waiting in a collective that another rank never joined.")
    return LaunchTimeoutError(
        f"launch timed out after {seconds:g} s: ranks {pending} of {world_size} had not finished "
        f"(finished: {finished}).{hint} If the work is just slow, raise timeout=.", pending, "run", finished)
