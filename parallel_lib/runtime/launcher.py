"""Launching ranks from a notebook or a script, with errors that reach the caller.

The classic tutorial starts ranks with ``Process(target=init_process, ...)``, sets
``MASTER_ADDRESS`` (the variable torch reads is ``MASTER_ADDR``), hard-codes port
29500 and keeps gloo's 30-minute default timeout. In a notebook that means a typo
in one rank hangs the cell for half an hour, and the second run collides with the
port the first one left behind. ``launch`` fixes each of these:

- every launch gets its own port: the calling process hosts the rendezvous store on
  a port the operating system picks, listening on 127.0.0.1 only
  (:mod:`parallel_lib.runtime.group`), and holds it until the launch ends, so two
  launches in a row or two notebooks at once never meet, and nobody else can;
- ranks start with the ``forkserver`` method (``spawn`` where there is none, on Windows),
  which works from a Jupyter kernel: each rank is a fresh process that imports the job's
  modules, but forked from a server that imported torch once, so a rank starts in a
  fraction of a second instead of seconds. The job is pickled here, and an object a rank
  cannot import (defined in a notebook cell) is named before any rank starts
  (:mod:`parallel_lib.runtime.payload`);
- each rank sends back its return value, or its traceback, over its own pipe
  (:mod:`parallel_lib.runtime.spawned`). The first error is raised in the caller as a
  ``RankError`` naming the rank and what the symptom usually means
  (:mod:`parallel_lib.runtime.failures`); the other ranks (possibly blocked in a
  collective) are terminated; start-up and the run each have a timeout
  (:mod:`parallel_lib.runtime.supervise`), and ranks exit if the caller dies, so
  nothing hangs and no process is left behind.

The same worker functions ``fn(rank, world_size, *args)`` run under ``torchrun``
through ``run_torchrun``; ``run`` picks whichever applies, so a command-line entry
point works both as ``python -m ...`` and as ``torchrun --nproc-per-node N -m ...``.
``python -m parallel_lib.runtime`` checks a machine's set-up either way (see
:mod:`parallel_lib.runtime.environment`).
"""

from __future__ import annotations

import inspect
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import pickle
import time
from typing import Any, Callable

import torch.distributed as dist

from parallel_lib.common.checks import positive_int, positive_number
from parallel_lib.runtime.failures import LaunchTimeoutError, RankError
from parallel_lib.runtime.group import BACKENDS, LOOPBACK, RankInfo, loopback_store, process_group, resolve_backend
from parallel_lib.runtime.main_guard import check_main_guard
from parallel_lib.runtime.payload import Job, dumps, in_notebook, pack_job
from parallel_lib.runtime.spawned import rank_main
from parallel_lib.runtime.supervise import STOP_GRACE_S, collect, stop

__all__ = ["RankError", "LaunchTimeoutError", "RankInfo", "BACKENDS", "launch", "run_torchrun", "run", "is_torchrun",
           "resolve_backend"]


# Imported once, by the fork server; only third-party modules, so that the course's modules
# and the reader's own worker files are imported afresh by every rank (an edit is picked up
# by the next launch, as with ``spawn``).
PRELOAD = ("torch", "torch.distributed", "transformers.models.gpt2.modeling_gpt2")

# Set in the fork server's environment only: torch.cuda.is_available() and device_count() then ask
# NVML instead of the CUDA driver, so that nothing the preloaded modules do at import initialises
# CUDA in the server. A CUDA context does not survive fork: every rank forked from such a server
# would fail at its first CUDA call ("Cannot re-initialize CUDA in forked subprocess").
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


def rank_context() -> Any:
    """The multiprocessing context ranks start from: a fork server with ``PRELOAD``, else spawn.

    Never plain ``fork``: forking a process that has started threads (a Jupyter kernel, an
    OpenMP pool, a CUDA context) can leave locks held forever in the child.
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))  # no effect once the server runs: it has them
    start_fork_server()
    return context


def start_fork_server() -> None:
    """Start the fork server (if it is not running) with ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` in its environment.

    The server inherits this process's environment when it starts; the variable is set for that
    moment only, so the caller's own environment (which every rank receives) is left as it was.
    """
    before = os.environ.get(NVML_CHECK)
    os.environ[NVML_CHECK] = "1"
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ[NVML_CHECK]
        else:
            os.environ[NVML_CHECK] = before


def _check_fn(fn: Any) -> None:
    if not callable(fn):
        raise TypeError(f"fn must be callable as fn(rank, world_size, *args), got fn={fn!r}")
    if getattr(fn, "__module__", None) == "__main__" and in_notebook():
        raise ValueError(f"fn={getattr(fn, '__qualname__', fn)!r} is defined in a notebook cell "
                         "or an interactive session, which spawned ranks cannot import; put it "
                         "in a module (e.g. parallel_lib) and import it from there")


def launch(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "auto",
           timeout: float = 60.0, startup_timeout: float = 60.0, threads_per_rank: int | None = None,
           host: str = LOOPBACK) -> list[Any]:
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
        *args: extra arguments for ``fn``, pickled into every rank (also defined in a module).
        backend: "auto" (NCCL when there is a GPU per rank, else gloo on the loopback
            interface), "gloo" or "nccl".
        timeout: seconds for the run, counted from the moment every rank has joined the
            process group; also each collective's own limit.
        startup_timeout: seconds for start-up: spawning, imports, joining the group.
        threads_per_rank: ``torch.set_num_threads`` in each rank; default is the rank's
            share of this machine's cores.
        host: the address the rendezvous store listens on; the default keeps it off the
            network. Change it only when something else must reach the store.

    Returns:
        ``[fn's return value on rank 0, ..., on rank world_size-1]``.

    Raises:
        RankError: a rank raised (message and ``traceback_text`` carry its traceback),
            could not load the job, or died without a Python exception (``exitcode``);
            the other ranks are stopped.
        LaunchTimeoutError: ranks still starting at ``startup_timeout``, or still running
            ``timeout`` seconds after all had started; all ranks are stopped.
        TypeError: ``fn`` is not callable.
        ValueError: bad ``world_size``, ``backend``, timeouts, ``threads_per_rank``, an
            ``fn``/``args`` that spawned processes cannot import, or a call from a script's top level
            outside ``if __name__ == "__main__":`` (every rank would run it again).
    """
    _check_fn(fn)
    check_main_guard(inspect.currentframe())  # a script's unguarded launch would run again in every rank
    positive_int("world_size", world_size)
    positive_number("timeout", timeout)
    positive_number("startup_timeout", startup_timeout)
    if threads_per_rank is not None:
        positive_int("threads_per_rank", threads_per_rank)
    if not isinstance(host, str) or not host:
        raise ValueError(f"host must be an address such as '127.0.0.1', got host={host!r}")
    backend = resolve_backend(backend, world_size)
    job = Job(fn, args, world_size, backend, host, float(timeout), float(startup_timeout), threads_per_rank,
              tuple(os.environ.items()))
    payload, main_names = pack_job(job)  # raises before anything starts
    # the rendezvous store lives here, on a port the OS picked and that stays ours until the end
    store = loopback_store(host, startup_timeout)
    context = rank_context()
    # a spawned rank's parent is this process; a forked one's is the fork server, which exits with us
    parent_pid = os.getpid() if context.get_start_method() == "spawn" else None
    procs: list[Any] = []
    conns: list[multiprocessing.connection.Connection] = []
    try:
        for rank in range(world_size):
            receiver, sender = context.Pipe(duplex=False)
            proc = context.Process(target=rank_main, args=(payload, rank, store.port, sender, parent_pid),
                                   name=f"rank{rank}")
            conns.append(receiver)
            proc.start()
            procs.append(proc)  # only started ones: the clean-up joins them
            sender.close()  # keep only the child's copy, so its death reads as end-of-file here
        results = collect(procs, conns, timeout, startup_timeout, main_names)
        grace_end = time.monotonic() + STOP_GRACE_S
        for proc in procs:  # results are in; give the ranks a moment to leave the group
            proc.join(max(0.0, grace_end - time.monotonic()))
        return results
    finally:  # on success, errors, timeouts and KeyboardInterrupt alike
        stop(procs, STOP_GRACE_S)
        for conn in conns:
            conn.close()
        del store


def is_torchrun() -> bool:
    """True in a process started by ``torchrun`` (or any launcher that sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_torchrun(fn: Callable[..., Any], *args: Any, backend: str = "auto", timeout: float = 60.0,
                 startup_timeout: float = 60.0, threads_per_rank: int | None = None) -> list[Any]:
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
        timeout: seconds each collective may wait.
        startup_timeout: seconds joining the group (the rendezvous) may take; the group's
            timeout is the larger of the two.
        threads_per_rank: ``torch.set_num_threads``; default is this rank's share of the host.

    Returns:
        ``[fn's return value on rank 0, ..., on rank WORLD_SIZE-1]``.

    Raises:
        ValueError: missing rank variables, an unknown backend or a bad timeout.
    """
    positive_number("timeout", timeout)
    positive_number("startup_timeout", startup_timeout)
    info = RankInfo.from_env()
    backend = resolve_backend(backend, info.local_world_size)
    with process_group(info, backend, max(timeout, startup_timeout), threads_per_rank):
        payloads: list[Any] = [None] * info.world_size
        dist.all_gather_object(payloads, dumps(fn(info.rank, info.world_size, *args)))
    return [pickle.loads(p) for p in payloads]


def run(fn: Callable[..., Any], world_size: int | None, *args: Any, **kwargs: Any) -> list[Any]:
    """``run_torchrun`` inside a torchrun job, else ``launch`` with ``world_size`` ranks.

    Args:
        fn: the worker function, called as ``fn(rank, world_size, *args)``.
        world_size: ranks to launch; under torchrun ``None`` or torchrun's ``WORLD_SIZE``.
        *args: extra arguments for ``fn``.
        **kwargs: ``backend``, ``timeout``, ``startup_timeout``, ``threads_per_rank`` (and
            ``host`` for ``launch``).

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
