"""Launching ranks from a notebook or a script, with errors that reach the caller.

The classic tutorial starts ranks with ``Process(target=init_process, ...)``, sets
``MASTER_ADDRESS`` (the variable torch reads is ``MASTER_ADDR``), hard-codes port
29500 and keeps gloo's 30-minute default timeout. In a notebook that means a typo
in one rank hangs the cell for half an hour, and the second run collides with the
port the first one left behind. ``launch`` fixes each of these:

- every launch gets its own port: the calling process hosts the rendezvous store on
  a port the operating system picks (port 0), and holds it until the launch ends, so
  two launches in a row or two notebooks at once never meet;
- ranks start with the ``spawn`` method, which works from a Jupyter kernel (``fn``
  must live in an importable module: a spawned process cannot import a cell);
- each rank sends back its return value, or its traceback, over its own pipe. The
  first error is raised in the caller as a ``RankError`` naming the rank, the other
  ranks (possibly blocked in a collective) are terminated, and every wait is bounded
  by ``timeout``, so nothing hangs and no process is left behind.

The same worker functions ``fn(rank, world_size, *args)`` run under ``torchrun``
through ``run_torchrun``; ``run`` picks whichever applies, so a command-line entry
point works both as ``python -m ...`` and as ``torchrun --nproc-per-node N -m ...``.
``python -m parallel_lib.runtime`` checks a machine's set-up either way (see
:mod:`parallel_lib.runtime.environment`).
"""

from __future__ import annotations

import io
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from parallel_lib.common.checks import positive_int, positive_number
from parallel_lib.runtime.device import cpu_count

__all__ = ["RankError", "LaunchTimeoutError", "RankInfo", "BACKENDS", "launch", "run_torchrun", "run", "is_torchrun",
           "resolve_backend"]

BACKENDS = ("auto", "gloo", "nccl")
_STOP_GRACE_S = 5.0  # how long a rank may take to exit after it was told to stop


class RankError(RuntimeError):
    """One or more ranks failed; the message names them and carries the rank's traceback.

    Attributes:
        ranks: the ranks the error is about (the failing one, or those that timed out).
        traceback_text: the traceback formatted inside the failing rank ("" if none).
        exitcode: the process exit code when a rank died without a Python exception.
    """

    def __init__(self, message: str, ranks: Sequence[int], traceback_text: str = "",
                 exitcode: int | None = None) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.traceback_text = traceback_text
        self.exitcode = exitcode


class LaunchTimeoutError(RankError):
    """Some ranks had not finished when ``launch``'s timeout ran out."""


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the job; read from the environment in this one place."""

    rank: int              # global rank, 0 .. world_size-1
    world_size: int        # number of processes in the default group
    local_rank: int        # index on this host: the GPU this rank drives
    local_world_size: int  # ranks on this host: they share its cores and GPUs

    @classmethod
    def from_env(cls) -> RankInfo:
        """Read ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``.

        ``torchrun`` and ``launch`` set all four; a single-host launcher that sets only
        ``RANK`` and ``WORLD_SIZE`` gets ``LOCAL_RANK = RANK`` and
        ``LOCAL_WORLD_SIZE = WORLD_SIZE``.

        Raises:
            ValueError: a variable is missing, not an integer, or out of range.
        """
        missing = [k for k in ("RANK", "WORLD_SIZE") if k not in os.environ]
        if missing:
            raise ValueError(f"environment variables {missing} are not set; start this process "
                             "with torchrun or parallel_lib.runtime.launcher")
        try:
            rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            local_rank = int(os.environ.get("LOCAL_RANK", rank))
            local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        except ValueError as e:
            raise ValueError(f"rank environment variables must be integers ({e})") from None
        if not 0 <= rank < world_size:
            raise ValueError(f"RANK must be in [0, WORLD_SIZE={world_size}), got RANK={rank}")
        if not 0 <= local_rank < local_world_size:
            raise ValueError(f"LOCAL_RANK must be in [0, LOCAL_WORLD_SIZE={local_world_size}), "
                             f"got LOCAL_RANK={local_rank}")
        return cls(rank, world_size, local_rank, local_world_size)

    def env(self) -> dict[str, str]:
        """The environment variables that ``from_env`` reads back as this object."""
        return dict(RANK=str(self.rank), WORLD_SIZE=str(self.world_size),
                    LOCAL_RANK=str(self.local_rank), LOCAL_WORLD_SIZE=str(self.local_world_size))


def resolve_backend(backend: str, ranks_per_host: int) -> str:
    """The process-group backend ``launch``/``run_torchrun`` use for ``backend``.

    "auto" gives NCCL when this host has a GPU for each of its ranks, else gloo on CPU.

    Raises:
        ValueError: an unknown backend, or "nccl" without enough GPUs.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got backend={backend!r}")
    enough_gpus = torch.cuda.device_count() >= ranks_per_host and dist.is_nccl_available()
    if backend == "nccl" and not enough_gpus:
        raise ValueError(f"backend='nccl' needs a GPU per rank: {ranks_per_host} ranks, "
                         f"{torch.cuda.device_count()} GPUs; use backend='gloo' or 'auto'")
    if backend == "auto":
        return "nccl" if enough_gpus else "gloo"
    return backend


def _loopback_interface() -> str:
    """The loopback interface's name ("lo" on Linux, "lo0" on macOS)."""
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    return names[0] if names else "lo"


@contextmanager
def _process_group(info: RankInfo, backend: str, timeout: float,
                   threads_per_rank: int | None, store: dist.Store | None = None) -> Iterator[None]:
    """Join the default process group for the body, and always leave it afterwards."""
    # ranks on one host share its cores: oversubscribed intra-op threads slow every rank down
    torch.set_num_threads(threads_per_rank or max(1, cpu_count() // info.local_world_size))
    if backend == "nccl":
        torch.cuda.set_device(info.local_rank)
    # store=None: env:// rendezvous on MASTER_ADDR/MASTER_PORT, as torchrun sets them up
    dist.init_process_group(backend, store=store, rank=info.rank, world_size=info.world_size,
                            timeout=timedelta(seconds=timeout))
    try:
        yield
    finally:  # even when fn raises, so the next run in this process starts clean
        dist.destroy_process_group()


class _CPUPickler(pickle.Pickler):
    """Pickles GPU tensors as CPU tensors, so the caller never has to touch a GPU."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
            return obj.detach().cpu().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return NotImplemented


def _dumps(obj: Any) -> bytes:
    # plain pickle copies tensor data into the bytes; torch's multiprocessing pickler would
    # pass shared-memory handles that die with the rank's process
    buffer = io.BytesIO()
    _CPUPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


@dataclass(frozen=True)
class _Job:
    """What every spawned rank needs to know (pickled into each child)."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    world_size: int
    backend: str
    port: int
    timeout: float
    threads_per_rank: int | None


def _rank_main(job: _Job, rank: int, conn: multiprocessing.connection.Connection) -> None:
    """Body of a spawned rank: join the group, run ``job.fn``, send ("ok"|"error", value, time)."""
    info = RankInfo(rank, job.world_size, rank, job.world_size)
    os.environ.update(info.env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job.port))
    if job.backend == "gloo":  # never try an external interface: every rank is on this host
        os.environ["GLOO_SOCKET_IFNAME"] = _loopback_interface()
    try:
        store = dist.TCPStore("127.0.0.1", job.port, is_master=False,
                              timeout=timedelta(seconds=job.timeout))
        with _process_group(info, job.backend, job.timeout, job.threads_per_rank, store):
            try:
                message = ("ok", job.fn(rank, job.world_size, *job.args), time.time())
            except BaseException:
                message = ("error", traceback.format_exc(), time.time())
            # send before tear-down: the caller should hear of the cause before its effects
            conn.send_bytes(_dumps(message))
    except BaseException:  # joining or leaving the group failed, or the result cannot be pickled
        conn.send_bytes(_dumps(("error", traceback.format_exc(), time.time())))
    finally:
        conn.close()


def _exit_reason(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"was killed by signal {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode}"


def _receive(conn: multiprocessing.connection.Connection) -> tuple[str, Any, float] | None:
    """A rank's message if one is waiting, else None (also at end-of-file: the rank died)."""
    if not conn.poll():
        return None
    try:
        return pickle.loads(conn.recv_bytes())
    except EOFError:
        return None


def _failure(world_size: int, errors: list[tuple[float, int, str]], deaths: list[tuple[int, Any]]
             ) -> RankError:
    """One error for the failures seen together, blaming the likeliest cause.

    A rank that dies or raises makes its peers' collectives fail soon after, so the
    root cause is a silent death if there is one, else the earliest traceback.
    """
    failed = sorted([r for _, r, _ in errors] + [r for r, _ in deaths])
    rank = deaths[0][0] if deaths else min(errors)[1]
    others = [r for r in failed if r != rank]
    also = f" (ranks {others} failed as well, probably in reaction)" if others else ""
    if deaths:
        code = deaths[0][1]
        return RankError(f"rank {rank} of {world_size} {_exit_reason(code)} before returning a "
                         f"result (a crash outside Python, os._exit or out of memory?){also}",
                         [rank], exitcode=code)
    text = min(errors)[2]
    return RankError(f"rank {rank} of {world_size} raised an exception{also}:\n{text}", [rank],
                     traceback_text=text)


def _collect(procs: list[Any], conns: list[multiprocessing.connection.Connection],
             deadline: float, timeout: float) -> list[Any]:
    """Wait for one message per rank; raise on errors, silent deaths or the deadline."""
    world_size = len(procs)
    results: dict[int, Any] = {}
    while len(results) < world_size:
        pending = [r for r in range(world_size) if r not in results]
        remaining = deadline - time.monotonic()
        waitables = [conns[r] for r in pending] + [procs[r].sentinel for r in pending]
        if remaining <= 0 or not multiprocessing.connection.wait(waitables, remaining):
            raise LaunchTimeoutError(
                f"launch timed out after {timeout:g} s: ranks {pending} of {world_size} had not "
                f"finished (finished: {sorted(results)}). A rank may be waiting in a collective "
                "that another rank never joined; if the work is just slow, raise timeout=.",
                pending)
        errors: list[tuple[float, int, str]] = []
        deaths: list[tuple[int, Any]] = []
        for r in pending:
            message = _receive(conns[r])
            if message is not None:
                status, value, when = message
                if status == "ok":
                    results[r] = value
                else:
                    errors.append((when, r, value))
            elif not procs[r].is_alive():
                procs[r].join(_STOP_GRACE_S)
                deaths.append((r, procs[r].exitcode))
        if errors or deaths:
            raise _failure(world_size, errors, deaths)
    return [results[r] for r in range(world_size)]


def _stop(procs: list[Any], grace: float) -> None:
    """Ask every rank to stop, then force it; returns once all have been reaped."""
    for p in procs:
        if p.is_alive():
            p.terminate()  # SIGTERM also interrupts a rank blocked in a collective
    for p in procs:
        p.join(grace)
        if p.is_alive():
            p.kill()
            p.join(grace)


def _check_fn(fn: Any) -> None:
    if not callable(fn):
        raise TypeError(f"fn must be callable as fn(rank, world_size, *args), got fn={fn!r}")
    main = sys.modules.get("__main__")
    if getattr(fn, "__module__", None) == "__main__" and not hasattr(main, "__file__"):
        raise ValueError(f"fn={getattr(fn, '__qualname__', fn)!r} is defined in a notebook cell "
                         "or an interactive session, which spawned ranks cannot import; put it "
                         "in a module (e.g. parallel_lib) and import it from there")
    try:
        pickle.dumps(fn)
    except Exception as e:  # lambdas, nested functions, bound methods of unpicklable objects
        raise ValueError(f"fn must be a module-level function that spawned ranks can import, "
                         f"got fn={fn!r} ({e})") from None


def launch(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "auto",
           timeout: float = 60.0, threads_per_rank: int | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` new processes; return the results.

    Each rank joins the default process group (``torch.distributed`` collectives work in
    ``fn``), sees ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` in its environment, and leaves the group when ``fn`` returns or
    raises. Return values are pickled back (GPU tensors arrive on the CPU). What ranks
    print goes to the terminal that started Jupyter, not to the notebook: return what
    you want to show.

    Args:
        fn: a function defined in an importable module (not a notebook cell).
        world_size: the number of ranks, >= 1.
        *args: extra arguments for ``fn``, pickled into every rank.
        backend: "auto" (NCCL when there is a GPU per rank, else gloo on the loopback
            interface), "gloo" or "nccl".
        timeout: seconds for the whole launch, start-up included, and for each
            collective inside it.
        threads_per_rank: ``torch.set_num_threads`` in each rank; default is the rank's
            share of this machine's cores.

    Returns:
        ``[fn's return value on rank 0, ..., on rank world_size-1]``.

    Raises:
        RankError: a rank raised (message and ``traceback_text`` carry its traceback) or
            died without a Python exception (``exitcode``); the other ranks are stopped.
        LaunchTimeoutError: ranks still running at ``timeout``; all ranks are stopped.
        TypeError: ``fn`` is not callable.
        ValueError: bad ``world_size``, ``backend``, ``timeout``, ``threads_per_rank``, or
            an ``fn`` that spawned processes cannot import.
    """
    _check_fn(fn)
    positive_int("world_size", world_size)
    positive_number("timeout", timeout)
    if threads_per_rank is not None:
        positive_int("threads_per_rank", threads_per_rank)
    backend = resolve_backend(backend, world_size)

    deadline = time.monotonic() + timeout
    # the rendezvous store lives here, on a port the OS picked and that stays ours until the end
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    job = _Job(fn, args, world_size, backend, store.port, float(timeout), threads_per_rank)
    context = multiprocessing.get_context("spawn")
    procs: list[Any] = []
    conns: list[multiprocessing.connection.Connection] = []
    try:
        for rank in range(world_size):
            receiver, sender = context.Pipe(duplex=False)
            proc = context.Process(target=_rank_main, args=(job, rank, sender), name=f"rank{rank}")
            conns.append(receiver)
            proc.start()
            procs.append(proc)  # only started ones: the clean-up joins them
            sender.close()  # keep only the child's copy, so its death reads as end-of-file here
        results = _collect(procs, conns, deadline, timeout)
        for proc in procs:  # results are in; give the ranks a moment to leave the group
            proc.join(max(0.0, min(_STOP_GRACE_S, deadline - time.monotonic())))
        return results
    finally:  # on success, errors, timeouts and KeyboardInterrupt alike
        _stop(procs, _STOP_GRACE_S)
        for conn in conns:
            conn.close()
        del store


def is_torchrun() -> bool:
    """True in a process started by ``torchrun`` (or any launcher that sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_torchrun(fn: Callable[..., Any], *args: Any, backend: str = "auto", timeout: float = 60.0,
                 threads_per_rank: int | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in this process, one rank of a ``torchrun`` job.

    Joins the group from the environment torchrun sets (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), calls ``fn``, gathers every
    rank's return value and leaves the group, also when ``fn`` raises. Each rank
    therefore gets the same list ``launch`` returns. Unlike ``launch`` it does not pin
    gloo to the loopback interface, because a torchrun job may span hosts.

    Args:
        fn: the same worker function ``launch`` takes.
        *args: extra arguments for ``fn``.
        backend: "auto" (NCCL when this host has a GPU per local rank), "gloo" or "nccl".
        timeout: seconds each collective, rendezvous included, may wait.
        threads_per_rank: ``torch.set_num_threads``; default is this rank's share of the host.

    Returns:
        ``[fn's return value on rank 0, ..., on rank WORLD_SIZE-1]``.

    Raises:
        ValueError: missing rank variables, an unknown backend or a bad timeout.
    """
    positive_number("timeout", timeout)
    info = RankInfo.from_env()
    backend = resolve_backend(backend, info.local_world_size)
    with _process_group(info, backend, timeout, threads_per_rank):
        payloads: list[Any] = [None] * info.world_size
        dist.all_gather_object(payloads, _dumps(fn(info.rank, info.world_size, *args)))
    return [pickle.loads(p) for p in payloads]


def run(fn: Callable[..., Any], world_size: int | None, *args: Any, **kwargs: Any) -> list[Any]:
    """``run_torchrun`` inside a torchrun job, else ``launch`` with ``world_size`` ranks.

    Args:
        fn: the worker function, called as ``fn(rank, world_size, *args)``.
        world_size: ranks to launch; under torchrun ``None`` or torchrun's ``WORLD_SIZE``.
        *args: extra arguments for ``fn``.
        **kwargs: ``backend``, ``timeout``, ``threads_per_rank``.

    Raises:
        ValueError: ``world_size`` disagrees with the torchrun job's ``WORLD_SIZE``.
    """
    if is_torchrun():
        torchrun_size = RankInfo.from_env().world_size
        if world_size is not None and world_size != torchrun_size:
            raise ValueError(f"world_size={world_size} but torchrun started {torchrun_size} ranks; "
                             "pass world_size=None or match --nproc-per-node x --nnodes")
        return run_torchrun(fn, *args, **kwargs)
    if world_size is None:
        raise ValueError("world_size=None is only allowed under torchrun; pass the number of ranks")
    return launch(fn, world_size, *args, **kwargs)
