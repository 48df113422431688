"""Worker functions for tests/test_dist.py, run inside ranks that ``launch`` spawns.

They live in a module (tests/ is on sys.path under pytest, and spawned children
inherit sys.path) because a spawned process cannot import a test function's locals.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from parallel_lib.runtime import RankInfo, rank_device


def describe_rank(rank: int, world_size: int, tag: str = "") -> dict:
    """What a rank sees: its arguments, the group, its environment and its threads."""
    return dict(rank=rank, world_size=world_size, tag=tag, info=RankInfo.from_env(),
                group_rank=dist.get_rank(), group_size=dist.get_world_size(),
                backend=dist.get_backend(), device=str(rank_device()),
                threads=torch.get_num_threads(), pid=os.getpid(),
                master=(os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]),
                ifname=os.environ.get("GLOO_SOCKET_IFNAME"), mark=os.environ.get("PARALLEL_LIB_TEST_MARK"))


def raise_on_rank_1(rank: int, world_size: int) -> int:
    """Rank 1 raises; the others wait in a collective that rank 1 never joins."""
    if rank == 1:
        raise ZeroDivisionError("deliberate failure in rank 1")
    dist.barrier()
    return rank


def hang_on_last_rank(rank: int, world_size: int) -> int:
    """The last rank sleeps far past any test timeout; the others finish."""
    if rank == world_size - 1:
        time.sleep(600)
    return rank


def exit_on_rank_1(rank: int, world_size: int) -> int:
    """Rank 1 dies without a Python exception, as a segfault or the OOM killer would."""
    if rank == 1:
        os._exit(7)
    dist.barrier()
    return rank


def count_every_kind(rank: int, world_size: int) -> tuple[dict, float, float]:
    """Issue one collective of each kind inside ``count_collectives``; return what was counted."""
    from parallel_lib.runtime.collectives import count_collectives
    from parallel_lib.runtime.compat import all_gather_single, reduce_scatter_single

    x = torch.ones(1000)  # 4000 bytes
    peer = (rank + 1) % world_size
    source = (rank - 1) % world_size
    with count_collectives() as outer:
        dist.all_reduce(x)
        with count_collectives() as inner:
            shard = torch.empty(1000 // world_size)
            reduce_scatter_single(shard, x)
            all_gather_single(torch.empty(1000), shard)
        received = torch.empty(10)
        ops = [dist.P2POp(dist.isend, torch.full((10,), float(rank)), peer), dist.P2POp(dist.irecv, received, source)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    dist.all_reduce(x)  # after the block: not counted
    return outer.by_kind(), outer.wire_bytes(), inner.calls_of(), received[0].item()
