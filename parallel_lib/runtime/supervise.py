"""The caller's side of a launch: wait for every rank's reports, each wait bounded, then stop them all.

Two clocks. Start-up (spawn, imports, the backend's initialisation) runs until every rank
has joined the process group, bounded by ``startup_timeout``; the run is bounded by
``timeout`` from that moment. A slow start on a busy machine is thus not mistaken for a
hang in the student's code, and a short ``timeout`` can be chosen for the run itself.
"""

from __future__ import annotations

import multiprocessing.connection
import pickle
import time
from typing import Any

from parallel_lib.runtime.failures import Reports, failure, job_error, run_timeout_error, startup_timeout_error

__all__ = ["collect", "stop", "STOP_GRACE_S"]

STOP_GRACE_S = 5.0  # how long a rank may take to exit after it was told to stop
_LATE_S = 1.0  # after a first failure, how long to listen for the root cause (a peer's death)


def _receive(conn: multiprocessing.connection.Connection) -> tuple[str, Any, float] | None:
    """A rank's message if one is waiting, else None (also at end-of-file: the rank died)."""
    if not conn.poll():
        return None
    try:
        return pickle.loads(conn.recv_bytes())
    except EOFError:
        return None


def collect(procs: list[Any], conns: list[multiprocessing.connection.Connection], timeout: float,
            startup_timeout: float, main_names: list[str]) -> list[Any]:
    """Wait for one result per rank; raise on errors, silent deaths or either deadline."""
    world_size = len(procs)
    reports = Reports(world_size, {}, [], [])
    started: set[int] = set()
    deadline = time.monotonic() + startup_timeout
    first_failure: float | None = None
    while len(reports.results) < world_size:
        pending = [r for r in range(world_size) if r not in reports.results and r not in reports.failed()]
        if first_failure is not None and (not pending or time.monotonic() >= first_failure):
            raise failure(reports)
        limit = deadline if first_failure is None else min(deadline, first_failure)
        waitables = [conns[r] for r in pending] + [procs[r].sentinel for r in pending]
        ready = multiprocessing.connection.wait(waitables, max(0.0, limit - time.monotonic()))
        if not ready and time.monotonic() >= deadline:
            if first_failure is not None:
                raise failure(reports)
            if len(started) < world_size:
                waiting = [r for r in range(world_size) if r not in started]
                raise startup_timeout_error(startup_timeout, world_size, waiting, sorted(started))
            raise run_timeout_error(timeout, world_size, pending, sorted(reports.results))
        for r in pending:
            message = _receive(conns[r])
            while message is not None:  # "started" and the result may both be waiting
                status, value, when = message
                if status == "job":
                    raise job_error(r, world_size, value, main_names)
                started.add(r)
                if status == "started" and len(started) == world_size:
                    deadline = time.monotonic() + timeout  # the run's clock starts now
                elif status == "ok":
                    reports.results[r] = value
                elif status == "error":
                    reports.errors.append((when, r, value))
                message = _receive(conns[r]) if status == "started" else None
            if r not in reports.results and r not in reports.failed() and not procs[r].is_alive():
                procs[r].join(STOP_GRACE_S)
                reports.deaths.append((r, procs[r].exitcode))
        if (reports.errors or reports.deaths) and first_failure is None:
            first_failure = time.monotonic() + _LATE_S  # a peer's death, the likelier cause, may follow
    return [reports.results[r] for r in range(world_size)]


def stop(procs: list[Any], grace: float) -> None:
    """Ask every rank to stop, then force it; returns once all have been reaped."""
    for p in procs:
        if p.is_alive():
            p.terminate()  # SIGTERM also interrupts a rank blocked in a collective
    for p in procs:
        p.join(grace)
        if p.is_alive():
            p.kill()
            p.join(grace)

