"""Device maps as pure data: balanced splits, the classic recipe, validation, balancing."""

import itertools
import random

import pytest
import torch

from parallel_lib.model_parallel import (
    balance_by_cost,
    format_device_map,
    get_device_map,
    lane_name,
    naive_device_map,
    validate_device_map,
)
from parallel_lib.runtime import devices, resolve_device


@pytest.mark.parametrize("n_devices", range(1, 9))
def test_get_device_map_properties(n_devices):
    devices = [f"dev{i}" for i in range(n_devices)]
    for n_layers in range(1, 49):
        device_map = get_device_map(n_layers, devices)
        assert list(device_map) == devices
        # contiguous, every layer exactly once, in device order
        assert [layer for layers in device_map.values() for layer in layers] == list(range(n_layers))
        sizes = [len(layers) for layers in device_map.values()]
        assert max(sizes) - min(sizes) <= 1, (n_layers, device_map)
        assert sizes == sorted(sizes, reverse=True), "earlier devices take the remainder"
        if n_layers >= n_devices:
            assert min(sizes) >= 1, f"idle device in {device_map}"
        validate_device_map(device_map, n_layers)


def test_get_device_map_gpt2_on_two_devices_is_the_classic_table():
    assert get_device_map(12, [0, 1]) == {0: [0, 1, 2, 3, 4, 5], 1: [6, 7, 8, 9, 10, 11]}


def test_naive_recipe_leaves_a_device_idle_where_the_balanced_map_does_not():
    assert naive_device_map(12, range(5)) == {0: [0, 1, 2], 1: [3, 4, 5], 2: [6, 7, 8], 3: [9, 10, 11], 4: []}
    assert get_device_map(12, range(5)) == {0: [0, 1, 2], 1: [3, 4, 5], 2: [6, 7], 3: [8, 9], 4: [10, 11]}
    assert naive_device_map(10, range(4)) == {0: [0, 1, 2], 1: [3, 4, 5], 2: [6, 7, 8], 3: [9]}


def test_fewer_layers_than_devices_leaves_the_last_devices_empty():
    assert get_device_map(2, [0, 1, 2]) == {0: [0], 1: [1], 2: []}


@pytest.mark.parametrize("n_layers", [0, -1, 2.0, True, "3"])
def test_bad_n_layers(n_layers):
    with pytest.raises(ValueError, match="n_layers must be an int >= 1"):
        get_device_map(n_layers, [0])


@pytest.mark.parametrize("devices, error, match", [
    ([], ValueError, "at least one device"),
    ([0, 0], ValueError, "distinct"),
    (["cuda:0", torch.device("cuda:0")], ValueError, "distinct"),
    ([-1], ValueError, ">= 0"),
    ([1.5], TypeError, "int, str or torch.device"),
    ([True], TypeError, "int, str or torch.device"),
])
def test_bad_devices(devices, error, match):
    with pytest.raises(error, match=match):
        get_device_map(4, devices)
    with pytest.raises(error, match=match):
        naive_device_map(4, devices)


@pytest.mark.parametrize("device_map", [
    {0: [0, 1], 1: [3]},  # layer 2 missing
    {0: [0, 1], 1: [1, 2, 3]},  # layer 1 twice
    {0: [2, 3], 1: [0, 1]},  # out of order
    {0: [0, 2], 1: [1, 3]},  # not contiguous
])
def test_validate_device_map_rejects(device_map):
    with pytest.raises(ValueError, match="once each, contiguous"):
        validate_device_map(device_map, 4)


def test_validate_device_map_accepts_idle_devices():
    validate_device_map({0: [0, 1], 1: [], 2: [2, 3]}, 4)


def test_resolve_device_and_lanes():
    gpus = torch.cuda.device_count()
    assert resolve_device(0) == (torch.device("cuda", 0) if gpus else torch.device("cpu"))
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("meta")) == torch.device("meta")
    assert [lane_name(k) for k in (0, "cuda:1", torch.device("cpu"))] == ["device 0", "cuda:1", "cpu"]


# --- one device rule, on machines with 0, 2 and 4 GPUs (torch.cuda.device_count faked) --------------

def _gpus(monkeypatch, n):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def test_without_gpus_every_int_key_runs_on_the_cpu(monkeypatch):
    _gpus(monkeypatch, 0)
    assert [resolve_device(k) for k in (0, 1, 7)] == [torch.device("cpu")] * 3
    assert devices(3) == [torch.device("cpu")] * 3
    with pytest.raises(ValueError, match=r"device key 'cuda:0' names GPU 0, but this machine has no GPU; use fewer"):
        resolve_device("cuda:0")  # an explicit GPU is not the CPU mode


def test_with_gpus_int_keys_are_gpus_and_a_missing_one_is_an_error(monkeypatch):
    _gpus(monkeypatch, 2)
    assert [resolve_device(k) for k in (0, 1)] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert resolve_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")
    for key in (2, "cuda:2", torch.device("cuda", 5)):
        with pytest.raises(ValueError, match=r"names GPU \d, but this machine has 2 GPUs \(cuda:0..cuda:1\); "
                                             r"use fewer devices, or 'cpu'"):
            resolve_device(key)


@pytest.mark.parametrize("gpus, n, expected", [
    (0, 4, ["cpu"] * 4), (4, 4, [f"cuda:{i}" for i in range(4)]), (4, 2, ["cuda:0", "cuda:1"]), (1, 1, ["cuda:0"]),
])
def test_devices_follows_the_same_rule(monkeypatch, gpus, n, expected):
    _gpus(monkeypatch, gpus)
    assert devices(n) == [torch.device(d) for d in expected]


@pytest.mark.parametrize("gpus, n", [(1, 2), (2, 4), (3, 4)])
def test_devices_between_none_and_enough_is_an_error(monkeypatch, gpus, n):
    _gpus(monkeypatch, gpus)
    message = rf"devices\(n={n}\) needs {n} GPUs, but this machine has {gpus} GPUs? \(cuda:0.*CUDA_VISIBLE_DEVICES="
    with pytest.raises(ValueError, match=message):
        devices(n)


def test_a_map_naming_a_missing_gpu_fails_before_anything_moves(monkeypatch):
    from torch import nn

    from parallel_lib.model_parallel import parallelize_sequential

    _gpus(monkeypatch, 1)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"device key 1 names GPU 1, but this machine has 1 GPU \(cuda:0\)"):
        parallelize_sequential(model, {0: [0], 1: [1]})
    assert all(p.device.type == "cpu" for p in model.parameters())  # on a real 1-GPU machine: nothing on cuda:0
    assert not hasattr(model, "device_map")


def test_balance_by_cost_with_equal_costs_is_get_device_map():
    for n_layers, n_devices in itertools.product(range(1, 20), range(1, 7)):
        devices = list(range(n_devices))
        assert balance_by_cost([1.0] * n_layers, devices) == get_device_map(n_layers, devices), (n_layers, n_devices)


def test_balance_by_cost_separates_a_heavy_layer_and_honours_pinned_costs():
    assert balance_by_cost([1, 1, 1, 1, 10], [0, 1]) == {0: [0, 1, 2, 3], 1: [4]}
    # 3 units pinned to the first device (embeddings): it should take one layer only
    assert balance_by_cost([1, 1, 1, 1], [0, 1], first_cost=3) == {0: [0], 1: [1, 2, 3]}
    assert balance_by_cost([1, 1, 1, 1], [0, 1], last_cost=3) == {0: [0, 1, 2], 1: [3]}


def _max_load(costs, sizes, first=0.0, last=0.0):
    loads, start = [], 0
    for size in sizes:
        loads.append(sum(costs[start:start + size]))
        start += size
    loads[0] += first
    loads[-1] += last
    return max(loads)


def test_balance_by_cost_is_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        n, k = rng.randint(1, 8), rng.randint(1, 4)
        costs = [rng.choice([0.0, 0.5, 1.0, 2.0, 7.0]) * rng.random() for _ in range(n)]
        first, last = rng.random() * 3, rng.random() * 3
        sizes = [len(v) for v in balance_by_cost(costs, list(range(k)), first, last).values()]
        used = [s for s in sizes if s] if n >= k else sizes[:n]
        best = min(_max_load(costs, [b - a for a, b in zip((0, *cuts), (*cuts, n))], first, last)
                   for cuts in itertools.combinations(range(1, n), min(k, n) - 1))
        assert _max_load(costs, used, first, last) == pytest.approx(best), (costs, k, sizes)


@pytest.mark.parametrize("costs, match", [([], "one cost per layer"), ([1, -1], "finite and >= 0"),
                                          ([1, float("nan")], "finite and >= 0")])
def test_balance_by_cost_bad_costs(costs, match):
    with pytest.raises(ValueError, match=match):
        balance_by_cost(costs, [0, 1])


def test_format_device_map():
    assert format_device_map(naive_device_map(5, [0, 1, 2]), resolve=False).splitlines() == [
        "     key  layers     count",
        "       0  0..1           2",
        "       1  2..3           2",
        "       2  4              1",
    ]
    assert format_device_map({"cpu": [0], 1: []}).splitlines()[1:] == [
        "     cpu       cpu  0              1",
        f"       1  {resolve_device(1)!s:>8}  (idle)         0",
    ]


def test_plot_device_maps_draws_one_cell_per_layer_on_its_device_row():
    import matplotlib
    matplotlib.use("Agg")
    from parallel_lib.viz.device_map import plot_device_maps

    fig = plot_device_maps({"classic": naive_device_map(12, range(5)), "balanced": get_device_map(12, range(5))})
    for ax, device_map in zip(fig.axes, (naive_device_map(12, range(5)), get_device_map(12, range(5)))):
        cells = sorted((int(p.get_x()), int(p.get_y())) for p in ax.patches)
        assert cells == sorted((layer, row) for row, layers in enumerate(device_map.values()) for layer in layers)
    assert "idle" in [t.get_text() for t in fig.axes[0].texts]
