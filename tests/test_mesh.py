"""The mesh: one layout of the ranks on named axes, every process group a slice, built once and destroyed.

Orders are checked against Megatron-LM's own example (``parallel_state.initialize_model_parallel``'s
docstring: 16 GPUs, tp=2, pp=4, dp=2) and against chapters 05 and 10's grids, written out as literals.
"""

import pytest
import torch

import _workers
from parallel_lib.runtime import launch
from parallel_lib.runtime.mesh import AXES, MEGATRON_ORDER, Mesh


def test_default_order_is_tp_fastest_then_pp_then_dp():
    mesh = Mesh(dp=2, tp=2, pp=2)
    assert mesh.world_size == 8 and mesh.ranks.shape == (2, 2, 1, 1, 2)
    torch.testing.assert_close(mesh.ranks[:, :, 0, 0, :], torch.arange(8).reshape(2, 2, 2))
    assert mesh.groups_of("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]  # neighbours: one node's fast links
    assert mesh.groups_of("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.groups_of("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh.tied_groups() == mesh.groups_of("pp")  # two stages: first and last are the whole pipeline
    assert mesh.coords(6) == {"dp": 1, "pp": 1, "ep": 0, "cp": 0, "tp": 0}


def test_chapter_05_grid_rows_are_pipelines_and_columns_dp_groups():
    mesh = Mesh(dp=3, pp=2)
    torch.testing.assert_close(mesh.ranks.flatten(1), torch.tensor([[0, 1], [2, 3], [4, 5]]))
    assert mesh.peers("pp", 2) == [2, 3] and mesh.peers("dp", 3) == [1, 3, 5]
    assert mesh.tied_groups()[2] == [4, 5] and Mesh(dp=2).tied_groups() == []


def test_megatron_order_matches_megatron_lms_own_example():
    # initialize_model_parallel's docstring: 16 GPUs, tp=2, pp=4 -> dp=2
    mesh = Mesh(dp=2, tp=2, pp=4, order=MEGATRON_ORDER)
    assert sorted(mesh.groups_of("tp")) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert mesh.groups_of("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert sorted(mesh.groups_of("dp")) == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert Mesh(dp=2, tp=2, pp=4, order="tp-dp-pp").ranks.equal(mesh.ranks)  # size-1 axes may be left out


@pytest.mark.parametrize("sizes", [dict(dp=2, tp=2, pp=2), dict(dp=3, pp=2, tp=4), dict(cp=2, tp=2, dp=2),
                                   dict(ep=4, dp=2), dict(dp=1)])
@pytest.mark.parametrize("order", ["tp-cp-ep-pp-dp", MEGATRON_ORDER, "dp-pp-ep-cp-tp"])
def test_every_axis_partitions_the_world_and_coordinates_round_trip(sizes, order):
    mesh = Mesh(order=order, **sizes)
    for axis in AXES:
        groups = mesh.groups_of(axis)
        assert sorted(r for g in groups for r in g) == list(range(mesh.world_size))
        assert all(len(g) == mesh.size(axis) for g in groups)
    for rank in range(mesh.world_size):
        coords = mesh.coords(rank)
        assert mesh.rank_at(**coords) == rank
        for axis in AXES:  # a group differs from its rank in that axis's coordinate only
            peers = mesh.peers(axis, rank)
            assert [mesh.coords(r)[axis] for r in peers] == list(range(mesh.size(axis)))
            assert all({a: c for a, c in mesh.coords(r).items() if a != axis}
                       == {a: c for a, c in coords.items() if a != axis} for r in peers)


def test_flattened_axes_and_of_world():
    mesh = Mesh(dp=2, cp=2, tp=2)
    assert mesh.groups_of(("dp", "cp")) == [[0, 2, 4, 6], [1, 3, 5, 7]] and mesh.size(("dp", "cp")) == 4
    assert Mesh.of_world(8, tp=2, pp=2) == Mesh(dp=2, tp=2, pp=2)
    assert "replica 1: stage 0 [4 5]   stage 1 [6 7]" in str(Mesh(dp=2, tp=2, pp=2))


@pytest.mark.parametrize("make, match", [
    (lambda: Mesh(dp=0), "dp must be an int >= 1, got dp=0"),
    (lambda: Mesh(pp=1.5), "pp must be an int >= 1"),
    (lambda: Mesh(tp=2, order="pp-dp"), "order"),
    (lambda: Mesh(order="tp-tp-dp"), "order"),
    (lambda: Mesh(order="tp-xx"), "order"),
    (lambda: Mesh(dp=2).coords(2), "rank"),
    (lambda: Mesh(dp=2).rank_at(dp=2), "dp"),
    (lambda: Mesh(dp=2).rank_at(zz=0), "unknown axis"),
    (lambda: Mesh(dp=2).groups_of("zz"), "unknown axis"),
    (lambda: Mesh.of_world(6, tp=4), "multiple"),
    (lambda: Mesh.of_world(6, dp=2, tp=2), "world_size"),
])
def test_bad_meshes_are_refused_by_name(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_build_outside_a_launch_says_how():
    with pytest.raises(RuntimeError, match="launch"):
        with Mesh().build():
            pass


def test_built_groups_reduce_over_their_slice_and_are_destroyed_on_exit():
    mesh = Mesh(dp=2, tp=2, pp=2)
    results = launch(_workers.mesh_groups, 8, mesh, [("dp", "tp")], timeout=120, startup_timeout=120)
    for rank, r in enumerate(results):
        for axis, (total, peers) in r["sums"].items():
            expected = mesh.peers(tuple(axis.split("-")) if "-" in axis else axis, rank) if axis != "tied" \
                else next(g for g in mesh.tied_groups() if rank in g)
            assert peers == expected and total == sum(expected), (rank, axis)
        assert r["coords"] == mesh.coords(rank) and r["index_tp"] == mesh.coords(rank)["tp"]
        # five axes + one flattened + tied, every group created on every rank
        assert r["groups_made"] == sum(len(mesh.groups_of(a)) for a in [*AXES, ("dp", "tp")]) + 4
        assert r["made"] > 0 and r["left"] == 0, "the mesh's groups outlived its with block"


def test_a_group_asked_after_the_block_or_never_built_raises():
    results = launch(_workers.mesh_misuse, 2, timeout=60, startup_timeout=60)
    assert results[0] == ["no group along", "only when pp > 1", "destroyed"]


def test_the_ring_and_zero_run_over_a_mesh_axis_not_the_world():
    """dp groups {0, 2} and {1, 3} of a (dp=2, tp=2) mesh: each sums and shards within itself only."""
    from torch import nn

    results = launch(_workers.lessons_on_a_mesh_axis, 4, timeout=180, startup_timeout=120)
    for rank, r in enumerate(results):
        peers = Mesh(dp=2, tp=2).peers("dp", rank)
        assert r["all_reduce"] == [sum(k + 10 * p for p in peers) for k in range(6)]
        mine = peers.index(rank)  # rank's chunk of the group's sum
        assert r["reduce_scatter"] == [sum(k + 10 * p for p in peers) for k in (2 * mine, 2 * mine + 1)]
        assert r["all_gather"] == [sum(k + 10 * p for p in peers) for k in range(4)]
        # one process: AdamW (ZeroEngine's defaults) on the mean of the group's two losses
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        data = [torch.randn(4, 8, generator=torch.Generator().manual_seed(p)) for p in peers]
        for _ in range(2):
            optimizer.zero_grad()
            (sum(model(d).pow(2).mean() for d in data) / 2).backward()
            optimizer.step()
        for stage in (1, 2, 3):
            for name, p in model.named_parameters():
                torch.testing.assert_close(r[f"zero{stage}"][name], p.detach(), msg=f"rank {rank} zero{stage} {name}")
