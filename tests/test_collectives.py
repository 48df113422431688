"""The collective counter: every kind counted once, with its message size and ring wire bytes.

Also the compatibility point for the collectives torch 2.13 renamed (``runtime.compat``).
"""

from __future__ import annotations

import warnings

import _workers
import pytest
import torch
import torch.distributed as dist

from parallel_lib.runtime import launch
from parallel_lib.runtime import compat
from parallel_lib.runtime.collectives import CollectiveCounter, count_collectives, ring_wire_bytes


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_counts_each_kind_once_and_restores_torch_distributed():
    before = dist.all_reduce
    results = launch(_workers.count_every_kind, 2, timeout=90)
    for rank, (by_kind, wire, inner_calls, received) in enumerate(results):
        assert by_kind == {"all_reduce": (1, 4000), "reduce_scatter": (1, 4000), "all_gather": (1, 4000),
                           "send": (1, 40), "recv": (1, 40)}
        # ring: all-reduce 2(N-1)/N S, reduce-scatter and all-gather (N-1)/N S each, a send S
        assert wire == pytest.approx(2 * 0.5 * 4000 + 0.5 * 4000 + 0.5 * 4000 + 40)
        assert inner_calls == 2
        assert received == (rank - 1) % 2  # the batched exchange really ran, with torch's own ops
    assert dist.all_reduce is before


def broadcast_from(rank: int, world_size: int, src: int) -> tuple[int, float, float]:
    """One broadcast of 4000 bytes from ``src``: (message bytes, this rank's wire bytes, value received)."""
    x = torch.full((1000,), float(rank))
    with count_collectives() as counter:
        dist.broadcast(x, src)
        dist.broadcast(x, group_src=src, group=dist.new_group(list(range(world_size))))
    return counter.nbytes("broadcast"), counter.wire_bytes("broadcast"), x[0].item()


def test_a_broadcast_is_charged_to_its_source_only():
    for rank, (nbytes, wire, value) in enumerate(launch(broadcast_from, 3, 1, timeout=90)):
        assert nbytes == 2 * 4000 and value == 1.0
        assert wire == (2 * 4000 if rank == 1 else 0.0), rank


@pytest.mark.parametrize("kind, expected", [("all_reduce", 1.5e3), ("reduce_scatter", 750.0), ("all_gather", 750.0),
                                            ("send", 1e3), ("recv", 0.0), ("broadcast", 1e3)])
def test_ring_wire_bytes(kind, expected):
    assert ring_wire_bytes(kind, 1000, 4) == expected


def test_outside_a_process_group_nothing_is_counted_and_the_functions_come_back():
    originals = {name: getattr(dist, name) for name in ("all_reduce", "isend", "batch_isend_irecv")}
    with count_collectives() as counter:
        assert dist.isend == originals["isend"]  # compares equal: P2POp accepts it
        assert dist.isend is not originals["isend"]  # point-to-point: wrapped; collectives: a dispatch mode
    assert isinstance(counter, CollectiveCounter) and counter.calls_of() == 0 and counter.by_kind() == {}
    assert all(getattr(dist, name) is fn for name, fn in originals.items())


def dtensor_traffic(rank: int, world_size: int) -> tuple[dict, list[float]]:
    """A DTensor redistribute (Shard -> Replicate: one all-gather) and a tensor-parallel Linear pair's forward."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    mlp = parallelize_module(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8)), mesh,
                             {"0": ColwiseParallel(), "1": RowwiseParallel()})
    sharded = distribute_tensor(torch.arange(8.0 * world_size), mesh, [Shard(0)])
    with count_collectives() as counter:
        gathered = sharded.redistribute(mesh, [Replicate()]).to_local()
        mlp(torch.ones(4, 8))  # the row-parallel layer's output: one all-reduce of (4, 8)
    return counter.by_kind(), gathered.tolist()


def test_dtensor_functional_collectives_are_counted():
    for by_kind, gathered in launch(dtensor_traffic, 2, backend="gloo", timeout=90):
        assert gathered == [float(i) for i in range(16)]
        assert by_kind == {"all_gather": (1, 16 * 4), "all_reduce": (1, 4 * 8 * 4)}


def renamed_collectives(rank: int, world_size: int) -> tuple[list[float], list[float], list[str]]:
    """Reduce-scatter and all-gather through the compatibility point, with every warning an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x = torch.arange(4.0) + rank
        shard, gathered = torch.empty(2), torch.empty(4)
        compat.reduce_scatter_single(shard, x)
        compat.all_gather_single(gathered, shard)
    return shard.tolist(), gathered.tolist(), [compat.collective_name(n) for n in compat._RENAMED]


def test_renamed_collectives_run_without_a_deprecation_warning():
    results = launch(renamed_collectives, 2, backend="gloo", timeout=90)
    for rank, (shard, gathered, names) in enumerate(results):
        assert shard == [2.0 * (2 * rank) + 1, 2.0 * (2 * rank + 1) + 1]  # (k) + (k + 1) summed over 2 ranks
        assert gathered == [1.0, 3.0, 5.0, 7.0]
        assert names == [n for n in compat._RENAMED if hasattr(dist, n)] + \
            [compat._RENAMED[n] for n in compat._RENAMED if not hasattr(dist, n)]


def test_the_old_names_are_used_where_torch_lacks_the_new_ones(monkeypatch):
    calls = []
    for new, old in compat._RENAMED.items():
        monkeypatch.delattr(dist, new, raising=False)
        monkeypatch.setattr(dist, old, lambda *args, name=old, **kwargs: calls.append((name, kwargs)))
    compat.reduce_scatter_single(torch.empty(1), torch.empty(2), async_op=True)
    compat.all_gather_single(torch.empty(2), torch.empty(1))
    assert [name for name, _ in calls] == ["reduce_scatter_tensor", "all_gather_into_tensor"]
    assert calls[0][1]["async_op"] is True and calls[1][1]["group"] is None


def test_the_library_calls_the_renamed_collectives_only_through_the_compatibility_point():
    import re
    from pathlib import Path

    names = "|".join(list(compat._RENAMED) + list(compat._RENAMED.values()))
    # a call (not a name in ``docs``) or a look-up by name, anywhere but in compat.py
    direct = re.compile(rf"(?<!`)dist\.({names})\(|getattr\(dist, \"({names})\"")
    root = Path(compat.__file__).resolve().parents[1]
    offenders = [str(p.relative_to(root)) for p in sorted(root.rglob("*.py"))
                 if p.name != "compat.py" and direct.search(p.read_text())]
    assert offenders == []
