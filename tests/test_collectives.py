"""The collective counter: every kind counted once, with its message size and ring wire bytes."""

from __future__ import annotations

import _workers
import pytest
import torch
import torch.distributed as dist

from parallel_lib.runtime import launch
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
        assert dist.all_reduce is not originals["all_reduce"]
    assert isinstance(counter, CollectiveCounter) and counter.calls_of() == 0 and counter.by_kind() == {}
    assert all(getattr(dist, name) is fn for name, fn in originals.items())
