"""Worker functions for tests/test_launch_faults.py: the mistakes students make, run inside real ranks.

They live in a module because spawned ranks import a worker by name (a test's locals cannot travel).
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist


def rank_and_value(rank: int, world_size: int, config: object) -> tuple[int, object]:
    """Return the config's ``value``: the job only has to arrive."""
    return rank, getattr(config, "value", config)


def mismatched_sizes(rank: int, world_size: int) -> int:
    """Each rank all-reduces a tensor of a different length (gloo aborts the process)."""
    dist.all_reduce(torch.ones(rank + 1))
    return rank


def collective_on_rank_0_only(rank: int, world_size: int) -> int:
    """Only rank 0 calls the all-reduce; the others return at once (the classic bug)."""
    if rank == 0:
        dist.all_reduce(torch.ones(4))
    return rank


def sleep_for(rank: int, world_size: int, seconds: float) -> int:
    time.sleep(seconds)
    return rank


def record_pid_and_sleep(rank: int, world_size: int, folder: str) -> int:
    """Write this rank's pid to ``folder/rank<r>.pid``, then sleep far past the test."""
    (Path(folder) / f"rank{rank}.pid").write_text(str(os.getpid()))
    time.sleep(120)
    return rank


def _slow(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


class SlowToUnpickle:
    """An argument that takes ``seconds`` to unpickle: a stand-in for slow imports at start-up."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __reduce__(self):
        return _slow, (self.seconds,)


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        pass
    return inodes


def _launch_pids() -> set[int]:
    """The caller of ``launch`` and every process it started (this rank and its peers)."""
    parent = os.getppid()
    pids = {parent, os.getpid()}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == parent:
                pids.add(int(entry))
    return pids


_LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


def exposed_listeners(rank: int, world_size: int) -> list[str]:
    """Listening TCP sockets of this launch (caller and ranks) on an address other than loopback."""
    dist.barrier()  # every rank has joined: the store and gloo's sockets are all up
    found = []
    if rank == 0:
        inodes = set().union(*(_socket_inodes(pid) for pid in _launch_pids()))
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                address, port = fields[1].split(":")
                if fields[3] == "0A" and fields[9] in inodes and address not in _LOOPBACK:
                    found.append(f"{table}: {address}:{int(port, 16)}")
    dist.barrier()
    return found


def socket_hostname() -> str:
    return socket.gethostname()


def mismatch_variant(rank: int, world_size: int, kind: str) -> int:
    if kind == "big":
        dist.all_reduce(torch.ones(1000 * (rank + 1)))
    elif kind == "shape":
        dist.all_reduce(torch.ones(4, rank + 2))
    elif kind == "broadcast":
        dist.broadcast(torch.ones(1000 * (rank + 1)), 0)
    elif kind == "gather":
        out = [torch.zeros(rank + 1) for _ in range(world_size)]
        dist.all_gather(out, torch.ones(rank + 1))
    elif kind == "dtype":
        dist.all_reduce(torch.ones(4, dtype=torch.float32 if rank else torch.float64))
    return rank
