"""Device maps: which consecutive layers of a model live on which device.

A device map is a plain dict ``{device: [layer indices]}``, the format the old
``transformers`` ``parallelize()`` used, so a reader can print it, compare it with
the classic article's table and pass it around. Keeping it pure data (no torch)
lets tests check every shape of split, and the same map drives the layer
placement, the timeline lanes and the memory report.

Device keys. A key is either an ``int`` (a device *index*, as the old Hugging Face
maps used), a string such as ``"cuda:1"`` or ``"cpu"``, or a ``torch.device``.
:func:`resolve_device` turns a key into the ``torch.device`` its layers run on: an
int ``k`` becomes ``cuda:k``, or ``cpu`` on a machine without GPUs (a key naming a GPU
the machine lacks is a ``ValueError``), while a string or ``torch.device`` is taken
literally. Int keys are how a CPU-only machine
says "several devices": the map ``{0: [0, 1], 1: [2, 3]}`` is recorded, validated
and honoured (hidden states still cross from "device 0" to "device 1", and the
timeline shows two lanes), yet every block computes on the CPU. The same notebook
cell then uses real GPUs on a machine that has them.

:func:`balance_by_cost` chooses the cut from measured per-layer costs; placing a
model according to a map is :mod:`parallel_lib.model_parallel`'s job.
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence

from parallel_lib.common.checks import positive_int
from parallel_lib.runtime.device import DeviceKey, resolve_device
from parallel_lib.runtime.device import check_device_keys as _check_devices

__all__ = [
    "DeviceKey",
    "DeviceMap",
    "get_device_map",
    "naive_device_map",
    "validate_device_map",
    "resolve_device",
    "lane_name",
    "balance_by_cost",
    "format_device_map",
]

DeviceMap = dict[DeviceKey, list[int]]


def _check_n_layers(n_layers: int) -> None:
    positive_int("n_layers", n_layers)


def get_device_map(n_layers: int, devices: Sequence[DeviceKey]) -> DeviceMap:
    """Split ``n_layers`` layers into contiguous, balanced blocks, one per device.

    Block sizes differ by at most one and the earlier devices take the remainder,
    so every device gets work whenever ``n_layers >= len(devices)``. With fewer
    layers than devices, the last devices get an empty list (they stay idle).

    Args:
        n_layers: number of transformer blocks (``config.n_layer``), at least 1.
        devices: the device keys in pipeline order (ints, strings or ``torch.device``).

    Returns:
        ``{device: [layer indices]}`` with every device as a key, in the given order.

    Raises:
        ValueError: ``n_layers < 1``, no devices, negative or duplicate devices.
        TypeError: a device key that is not an int, str or ``torch.device``.

    Example:
        >>> get_device_map(12, [0, 1, 2, 3, 4])
        {0: [0, 1, 2], 1: [3, 4, 5], 2: [6, 7], 3: [8, 9], 4: [10, 11]}
    """
    _check_n_layers(n_layers)
    devices = _check_devices(devices)
    base, extra = divmod(n_layers, len(devices))
    return _from_sizes(devices, [base + (1 if i < extra else 0) for i in range(len(devices))])


def _from_sizes(devices: Sequence[DeviceKey], sizes: Sequence[int]) -> DeviceMap:
    """``{device: [layers]}`` taking ``sizes[i]`` consecutive layers for ``devices[i]``."""
    ends = list(itertools.accumulate(sizes))
    return {d: list(range(end - size, end)) for d, size, end in zip(devices, sizes, ends)}


def naive_device_map(n_layers: int, devices: Sequence[DeviceKey]) -> DeviceMap:
    """The classic recipe: blocks of ``ceil(n_layers / n_devices)`` layers.

    Kept for understanding, beside :func:`get_device_map`: the old transformers
    ``get_device_map`` cut the layer list into chunks of this fixed size and zipped
    them with the devices. When the division is not exact, the last block is short
    and trailing devices get nothing: 12 layers on 5 devices gives 3+3+3+3+0, so one
    device of five sits idle while four carry 3 layers each. Devices left without
    a block appear here with an empty list (the original silently dropped them).

    Args and Raises: as for :func:`get_device_map`.
    """
    _check_n_layers(n_layers)
    devices = _check_devices(devices)
    block = math.ceil(n_layers / len(devices))
    return {d: list(range(i * block, min((i + 1) * block, n_layers))) for i, d in enumerate(devices)}


def validate_device_map(device_map: DeviceMap, n_layers: int) -> None:
    """Check that a map places layers ``0..n_layers-1`` once each, in contiguous order.

    Contiguous means: reading the devices in the map's order and each device's
    list in order gives exactly ``0, 1, ..., n_layers - 1``; a hidden state then
    visits every device at most once on its way through the model.

    Raises:
        ValueError: a missing, repeated or out-of-order layer, or no devices.
        TypeError: a key that is not a device key.
    """
    _check_n_layers(n_layers)
    if not isinstance(device_map, dict):
        raise TypeError(f"device_map must be a dict {{device: [layers]}}, got {type(device_map).__name__}")
    _check_devices(list(device_map))
    order = [layer for layers in device_map.values() for layer in layers]
    if order != list(range(n_layers)):
        raise ValueError(f"device_map must list layers 0..{n_layers - 1} once each, contiguous and in order "
                         f"of the devices, got device_map={device_map!r}; get_device_map({n_layers}, devices) "
                         "builds one")


def lane_name(key: DeviceKey) -> str:
    """Timeline lane of a map key: ``"device k"`` for an int, else the device string.

    Lanes are named by the *key*, not the resolved device, so two int keys that
    both run on the CPU still get two lanes.
    """
    return f"device {key}" if isinstance(key, int) else str(key)


# --------------------------------------------------------------------------- balancing
#
# torchgpipe's ``balance`` package showed the recipe: measure a cost per layer
# (parameter bytes or profiled time), then cut the layer sequence into contiguous
# blocks so that the most loaded device carries as little as possible (it uses the
# block-partition algorithm of Bárány and Grinberg). Here the cut is an exact
# dynamic programme: the sequences are short (tens of layers), so O(k n^2) is instant
# and there is no approximation to explain.


def _min_max_sizes(costs: list[float], k: int, first: float, last: float) -> list[int]:
    """Sizes of k contiguous non-empty parts of ``costs`` (k <= len) minimising the largest load.

    ``first`` and ``last`` are pinned costs added to part 0 and part k-1 (GPT-2's
    embeddings and final layer norm). [1] finds the smallest achievable maximum load;
    [2] picks, among splits within that bound, the most even one (least sum of squared
    loads), ties giving the earlier parts more layers, so equal costs reproduce
    :func:`get_device_map`.
    """
    n = len(costs)
    prefix = [0.0, *itertools.accumulate(costs)]

    def load(j: int, a: int, b: int) -> float:  # part j holds items a .. b-1
        return prefix[b] - prefix[a] + (first if j == 0 else 0.0) + (last if j == k - 1 else 0.0)

    # [1] worst[j][i]: the smallest possible maximum load with items 0..i-1 in parts 0..j
    worst = [[math.inf] * (n + 1) for _ in range(k)]
    worst[0][1:] = [load(0, 0, i) for i in range(1, n + 1)]
    for j in range(1, k):
        for i in range(j + 1, n + 1):
            worst[j][i] = min(max(worst[j - 1][a], load(j, a, i)) for a in range(j, i))
    bound = worst[k - 1][n] * (1 + 1e-9) + 1e-12  # float slack: sums in another order differ in the last bit
    # [2] spread[j][i]: least sum of squared loads with every load <= bound; cut[j][i]: where part j starts
    spread = [[math.inf] * (n + 1) for _ in range(k)]
    cut = [[0] * (n + 1) for _ in range(k)]
    spread[0][1:] = [load(0, 0, i) ** 2 if load(0, 0, i) <= bound else math.inf for i in range(1, n + 1)]
    for j in range(1, k):
        for i in range(j + 1, n + 1):
            for a in range(i - 1, j - 1, -1):  # descending: on ties the later part stays the shorter one
                part = load(j, a, i)
                if part <= bound and spread[j - 1][a] + part * part < spread[j][i]:
                    spread[j][i], cut[j][i] = spread[j - 1][a] + part * part, a
    sizes, end = [], n
    for j in range(k - 1, 0, -1):
        sizes.append(end - cut[j][end])
        end = cut[j][end]
    return [end, *reversed(sizes)]


def balance_by_cost(costs: Sequence[float], devices: Sequence[DeviceKey],
                    first_cost: float = 0.0, last_cost: float = 0.0) -> DeviceMap:
    """Contiguous device map whose most loaded device carries the least total cost.

    Args:
        costs: one non-negative cost per layer (bytes, seconds, ...).
        devices: device keys in pipeline order.
        first_cost: cost that always sits on the first device (e.g. the embeddings).
        last_cost: cost that always sits with the last layer (e.g. the final layer norm).

    Returns:
        ``{device: [layers]}``; every device gets at least one layer when there are
        enough layers, and equal costs give exactly :func:`get_device_map`.

    Raises:
        ValueError: no costs, or a negative or non-finite cost; bad devices as in
            :func:`get_device_map`.
    """
    values = [float(c) for c in costs]
    if not values:
        raise ValueError("costs must hold one cost per layer, got costs=[]")
    if not all(math.isfinite(c) and c >= 0 for c in [*values, first_cost, last_cost]):
        raise ValueError(f"costs must be finite and >= 0, got costs={values!r}, "
                         f"first_cost={first_cost!r}, last_cost={last_cost!r}")
    devices = _check_devices(devices)
    k = min(len(devices), len(values))
    return _from_sizes(devices, _min_max_sizes(values, k, first_cost, last_cost) + [0] * (len(devices) - k))


def format_device_map(device_map: DeviceMap, resolve: bool = True) -> str:
    """A fixed-width table: key, the device it resolves to here (if ``resolve``), its layers, their count.

    Pass ``resolve=False`` for output that must not depend on the machine's GPUs.
    """
    lines = [f"{'key':>8}  " + (f"{'runs on':>8}  " if resolve else "") + f"{'layers':<10} {'count':>5}"]
    for key, layers in device_map.items():
        span = "(idle)" if not layers else f"{layers[0]}..{layers[-1]}" if len(layers) > 1 else str(layers[0])
        where = f"{resolve_device(key)!s:>8}  " if resolve else ""
        lines.append(f"{key!s:>8}  {where}{span:<10} {len(layers):>5}")
    return "\n".join(lines)
