"""The entry point of a rank that ``launch`` spawned: everything here runs in the child.

A rank reports over its pipe, in order: ``("started", None, t)`` once it has joined the
process group (the caller's start-up timeout ends there), then ``("ok", value, t)`` or
``("error", traceback, t)``. A failure before the job is even unpickled is sent as
``("job", traceback, t)``, so the caller can say which object could not travel.

A rank also watches its parent: if the caller is killed outright (the out-of-memory
killer, ``kill -9`` on the kernel), nothing would ever terminate the ranks, which
would sit in a collective, holding memory and cores, until the machine reboots.
"""

from __future__ import annotations

import ctypes
import multiprocessing.connection
import multiprocessing.forkserver
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from parallel_lib.runtime.group import RankInfo, loopback_interface, process_group
from parallel_lib.runtime.payload import dumps, unpack_job

__all__ = ["rank_main", "watch_parent", "check_cuda_untouched"]

_PARENT_POLL_S = 0.25  # how often a rank checks that its caller is still alive
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def watch_parent(parent_pid: int | None = None) -> None:
    """End this process as soon as ``parent_pid`` is no longer its parent (the parent died).

    On Linux the kernel delivers SIGKILL at the parent's death (``PR_SET_PDEATHSIG``), even
    while this process is stuck in C code; everywhere, a daemon thread also polls the
    parent id, which changes when the process is re-parented. ``None`` watches whatever the
    parent is now: a fork server, which itself exits when the caller that started it dies.
    """
    if parent_pid is None:
        parent_pid = os.getppid()
        _let_fork_server_exit()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):  # no prctl in this libc: the thread below still works
            pass

    def poll() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_S)
        os._exit(1)  # the caller is gone: nobody would read our result or stop us

    if os.getppid() != parent_pid:  # it died before the watch was set up
        os._exit(1)
    threading.Thread(target=poll, name="parent-watch", daemon=True).start()


def _let_fork_server_exit() -> None:
    """Close this rank's copy of the fork server's "alive" pipe.

    The server exits when no process holds that pipe's write end any more, and it hands a
    copy to every child it forks: left open, the ranks would keep the server alive after the
    caller died, and the server (their parent) would keep them alive in turn. Closed, the
    caller's death ends the server, and the server's death ends the ranks (above). A rank
    that launches ranks itself starts a fork server of its own.
    """
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
        server._forkserver_alive_fd = None


def check_cuda_untouched(rank: int, is_initialized: Callable[[], bool] = torch.cuda.is_initialized) -> None:
    """Raise unless CUDA is still uninitialised in this rank, as it must be before ``torch.cuda.set_device``.

    A rank forked from a fork server inherits the server's CUDA state, and a CUDA context does
    not survive ``fork``: the rank's first CUDA call would fail, or hang, far from the cause.
    ``launch`` starts the server so that importing its modules cannot initialise CUDA
    (``PYTORCH_NVML_BASED_CUDA_CHECK=1``); this check catches whatever still does.

    Raises:
        RuntimeError: CUDA was initialised before the rank chose its GPU.
    """
    if is_initialized():
        raise RuntimeError(f"rank {rank}: CUDA is already initialised before torch.cuda.set_device; the rank was "
                           "forked from a process that had initialised CUDA (a preloaded module or code run at "
                           "import time touched the GPU), and a CUDA context does not survive fork. Move the CUDA "
                           "call out of module import time, into the worker function")


def _send(conn: multiprocessing.connection.Connection, status: str, value: Any) -> None:
    conn.send_bytes(dumps((status, value, time.time())))


def rank_main(payload: bytes, rank: int, port: int, conn: multiprocessing.connection.Connection,
              parent_pid: int | None) -> None:
    """Body of a spawned rank: load the job, join the group, run ``job.fn``, report each step.

    ``parent_pid``: the caller's pid for a spawned rank, None for one forked by a fork server.
    """
    watch_parent(parent_pid)
    try:
        try:
            job = unpack_job(payload)  # imports fn's module: may fail for objects left in __main__
        except BaseException:
            _send(conn, "job", traceback.format_exc())
            return
        info = RankInfo(rank, job.world_size, rank, job.world_size)
        if job.environment:  # the caller's, as a spawned rank would have inherited it
            os.environ.clear()
            os.environ.update(job.environment)
        os.environ.update(info.env(), MASTER_ADDR=job.host, MASTER_PORT=str(port))
        if job.backend == "gloo":  # never try an external interface: every rank is on this host
            os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()
        try:
            if job.backend == "nccl":
                check_cuda_untouched(rank)  # before process_group's set_device
            store = dist.TCPStore(job.host, port, is_master=False,
                                  timeout=timedelta(seconds=job.startup_timeout))
            # the group's own timeout bounds each collective; it also covers joining, hence the max
            with process_group(info, job.backend, max(job.timeout, job.startup_timeout), job.threads_per_rank,
                               store):
                _send(conn, "started", None)
                try:
                    message = ("ok", job.fn(rank, job.world_size, *job.args))
                except BaseException:
                    message = ("error", traceback.format_exc())
                # send before tear-down: the caller should hear of the cause before its effects
                _send(conn, *message)
        except BaseException:  # joining or leaving the group failed, or the result cannot be pickled
            _send(conn, "error", traceback.format_exc())
    finally:
        conn.close()
