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


def mesh_groups(rank: int, world_size: int, mesh, flatten=()) -> dict:
    """Build the mesh; sum each rank's number over every axis's group; report what was made and destroyed."""
    from torch.distributed import distributed_c10d as c10d

    before = len(c10d._world.pg_map)
    sums = {}
    with mesh.build(timeout=30, flatten=flatten) as pm:
        made = len(c10d._world.pg_map) - before
        for axis in ["dp", "pp", "tp", *flatten, *(["tied"] if mesh.pp > 1 else [])]:
            x = torch.tensor([float(rank)])
            dist.all_reduce(x, group=pm.group(axis))
            sums[axis if isinstance(axis, str) else "-".join(axis)] = (x.item(), pm.peers(axis))
        coords, index_tp, groups_made = pm.coords, pm.index("tp"), pm.groups_made
    return dict(sums=sums, made=made, left=len(c10d._world.pg_map) - before, coords=coords, index_tp=index_tp,
                groups_made=groups_made)


def mesh_misuse(rank: int, world_size: int) -> list[str]:
    """The errors a rank gets for a flattened group not built, a tied group without pp, a dead mesh."""
    from parallel_lib.runtime.mesh import Mesh

    seen = []
    with Mesh(dp=2).build(timeout=30) as pm:
        for axis in [("dp", "tp"), "tied"]:
            try:
                pm.group(axis)
            except ValueError as error:
                seen.append("no group along" if "no group along" in str(error) else "only when pp > 1")
    try:
        pm.group("dp")
    except RuntimeError as error:
        seen.append("destroyed" if "destroyed" in str(error) else str(error))
    return seen


def tp_runs_leave_no_groups(rank: int, world_size: int, config) -> tuple[int, int, int]:
    """Process groups alive before, between and after two tensor-parallel runs in one launch."""
    from torch.distributed import distributed_c10d as c10d

    from parallel_lib.training import tp_layout, train

    plan, run = tp_layout(config, world_size, return_state=False)
    before = len(c10d._world.pg_map)
    train(rank, world_size, plan, run)
    between = len(c10d._world.pg_map)
    train(rank, world_size, plan, run)
    return before, between, len(c10d._world.pg_map)


def lessons_on_a_mesh_axis(rank: int, world_size: int, stages: tuple = (1, 2, 3)) -> dict:
    """The ring's collectives and ZeRO over the dp axis of a (dp=2, tp=2) mesh: groups {0, 2} and {1, 3}."""
    from torch import nn

    from parallel_lib.data_parallel.ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter
    from parallel_lib.runtime.mesh import Mesh
    from parallel_lib.sharding import ZeroEngine

    out: dict = {}
    with Mesh(dp=2, tp=2).build(timeout=30) as pm:
        group = pm.group("dp")
        x = torch.arange(6.0) + 10 * rank
        out["all_reduce"] = ring_all_reduce(x, group=group).tolist()
        shard = torch.empty(2)
        out["reduce_scatter"] = ring_reduce_scatter(shard, torch.arange(4.0) + 10 * rank, group=group).tolist()
        out["all_gather"] = ring_all_gather(torch.empty(4), shard, group=group).tolist()
        data = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
        for stage in stages:
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
            engine = ZeroEngine(model, stage=stage, group=group, layer_groups=[model[0], model[2]])
            for _ in range(2):
                model(data).pow(2).mean().backward()
                engine.step()
            engine.remove()
            out[f"zero{stage}"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out
