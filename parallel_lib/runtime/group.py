"""Where a rank sits in the job, which backend it uses, and joining the process group.

The rendezvous store is the one server a launch opens. ``torch.distributed.TCPStore``
listens on every interface when it opens its own socket, whatever host name it is
given, so anyone on a classroom network could read or write its keys during a run.
:func:`loopback_store` therefore binds the listening socket itself, to 127.0.0.1
unless the caller asks for another address, and hands it to the store
(``master_listen_fd``). Gloo is pinned to the loopback interface in the same spirit.
"""

from __future__ import annotations

import os
import socket
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

from parallel_lib.runtime.device import cpu_count
from parallel_lib.runtime.guard import guard_from_environment

__all__ = ["BACKENDS", "RankInfo", "resolve_backend", "loopback_interface", "loopback_store", "process_group"]

BACKENDS = ("auto", "gloo", "nccl")
LOOPBACK = "127.0.0.1"


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

    "auto" gives NCCL when this host has a GPU for each of its ranks, else gloo on CPU;
    on a host that has GPUs, but too few, it warns (naming both numbers) before falling
    back, since the run is then far slower than the reader expects.

    Raises:
        ValueError: an unknown backend, or "nccl" without enough GPUs.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got backend={backend!r}")
    gpus = torch.cuda.device_count()
    enough_gpus = gpus >= ranks_per_host and dist.is_nccl_available()
    if backend == "nccl" and not enough_gpus:
        raise ValueError(f"backend='nccl' needs a GPU per rank: {ranks_per_host} ranks, "
                         f"{gpus} GPUs; use backend='gloo' or 'auto'")
    if backend == "auto" and not enough_gpus and gpus > 0:
        reason = (f"{ranks_per_host} ranks on this host but only {gpus} GPU(s)" if gpus < ranks_per_host
                  else f"{gpus} GPU(s) but this torch build has no NCCL")
        warnings.warn(f"backend='auto': {reason}; falling back to gloo on the CPU. Use at most {gpus} ranks "
                      "for NCCL, or pass backend='gloo' to choose the CPU knowingly.", RuntimeWarning, stacklevel=3)
    if backend == "auto":
        return "nccl" if enough_gpus else "gloo"
    return backend


def loopback_interface() -> str:
    """The loopback interface's name ("lo" on Linux, "lo0" on macOS)."""
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    return names[0] if names else "lo"


def loopback_store(host: str, timeout: float) -> dist.TCPStore:
    """A master ``TCPStore`` listening on ``host`` only, on a port the OS picks.

    The store owns the listening socket and closes it with its last reference: keep the
    store until the launch ends, and the port is ours until then.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        try:
            listener.bind((host, 0))
        except OSError as e:
            raise ValueError(f"host={host!r} is not an address of this machine to listen on ({e}); "
                             f"keep the default {LOOPBACK!r}") from None
        listener.listen(128)
        store = dist.TCPStore(host, listener.getsockname()[1], is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=timeout), master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store closes the descriptor itself
    return store


@contextmanager
def process_group(info: RankInfo, backend: str, timeout: float,
                  threads_per_rank: int | None, store: dist.Store | None = None) -> Iterator[None]:
    """Join the default process group for the body, and always leave it afterwards.

    With ``PARALLEL_LIB_GUARD=1`` in the environment (the test suite sets it), the body runs
    under the collective guard (:mod:`parallel_lib.runtime.guard`).
    """
    # ranks on one host share its cores: oversubscribed intra-op threads slow every rank down
    torch.set_num_threads(threads_per_rank or max(1, cpu_count() // info.local_world_size))
    if backend == "nccl":
        torch.cuda.set_device(info.local_rank)
    # store=None: env:// rendezvous on MASTER_ADDR/MASTER_PORT, as torchrun sets them up
    dist.init_process_group(backend, store=store, rank=info.rank, world_size=info.world_size,
                            timeout=timedelta(seconds=timeout))
    try:
        # gloo's rendezvous can return on one rank while a peer is still connecting to it; a rank
        # that finished at once would then close its sockets under that peer ("Connection closed
        # by peer"). One barrier means every rank has joined before any starts its work.
        dist.barrier(device_ids=[info.local_rank]) if backend == "nccl" else dist.barrier()
        guard_from_environment()
        yield
    finally:  # even when fn raises, so the next run in this process starts clean
        dist.destroy_process_group()
