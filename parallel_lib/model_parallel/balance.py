"""Choosing a device map: even out parameters (memory) or measured time per device.

torchgpipe's ``balance`` package showed the recipe: measure a cost per layer
(parameter bytes or profiled time), then cut the layer sequence into contiguous
blocks so that the most loaded device carries as little as possible.
:func:`~parallel_lib.model_parallel.device_map.balance_by_cost` does the cut.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

import torch
from torch import nn

from parallel_lib.common.checks import positive_int
from parallel_lib.model_parallel.device_map import DeviceKey, DeviceMap, balance_by_cost
from parallel_lib.model_parallel.placing import FIRST, LAST, layout
from parallel_lib.model_parallel.timeline import record_timeline

__all__ = ["balance_by_params", "balance_by_time"]


def _balance(model: nn.Module, cost: dict[str, float], devices: Sequence[DeviceKey]) -> DeviceMap:
    """Map from a cost per part name: blocks are cut, pinned parts load the first/last device."""
    parts = layout(model)
    pinned = {where: sum(cost.get(name, 0.0) for name, _, w in parts if w == where) for where in (FIRST, LAST)}
    blocks = [cost.get(name, 0.0) for name, _, where in parts if isinstance(where, int)]
    return balance_by_cost(blocks, devices, first_cost=pinned[FIRST], last_cost=pinned[LAST])


def balance_by_params(model: nn.Module, devices: Sequence[DeviceKey]) -> DeviceMap:
    """Device map that evens out parameter counts (a memory balance).

    For GPT-2 the embeddings (and the tied head, counted once) sit on the first
    device, so with a large vocabulary that device gets fewer blocks.

    Args:
        model: a ``GPT2LMHeadModel``, ``GPT2Model`` or ``nn.Sequential``.
        devices: device keys in pipeline order.
    """
    seen: set[int] = set()
    cost: dict[str, float] = {}
    for name, module, _ in layout(model):
        fresh = [p for p in module.parameters() if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        cost[name] = float(sum(p.numel() for p in fresh))
    return _balance(model, cost, devices)


def _forward_backward(model: nn.Module, sample: Any) -> None:
    out = model(**sample) if isinstance(sample, dict) else model(sample)
    y = out if isinstance(out, torch.Tensor) else out[0]  # logits, loss or last hidden state
    params = [p for p in model.parameters() if p.requires_grad]
    torch.autograd.grad(y.float().mean(), params)  # fires the timing hooks; leaves .grad untouched


def balance_by_time(model: nn.Module, sample: Any, devices: Sequence[DeviceKey], repeat: int = 3) -> DeviceMap:
    """Device map that evens out measured forward + backward time per device.

    Profiles the model where it currently sits (one warm-up pass, then ``repeat``
    timed passes recorded by :func:`record_timeline`), averages each part's time,
    and cuts the blocks with :func:`~parallel_lib.model_parallel.device_map.balance_by_cost`.
    Parameters' ``.grad`` are not touched.

    Args:
        model: a ``GPT2LMHeadModel``, ``GPT2Model`` or ``nn.Sequential``.
        sample: a representative input: a tensor, or a dict of keyword arguments.
        devices: device keys in pipeline order.
        repeat: timed passes to average (noise shrinks with more).

    Raises:
        ValueError: ``repeat`` not an int >= 1 (a bool or a float included).
    """
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got repeat={repeat!r}")
    positive_int("repeat", repeat, hint="timed passes to average")  # and an int: not True, not 2.0
    with record_timeline(model) as events:
        for _ in range(repeat + 1):
            _forward_backward(model, sample)
    cost: dict[str, float] = defaultdict(float)
    for event in events:
        if event.micro_batch != 0:  # pass 0 warms up allocators and kernels
            cost[event.label] += event.duration / repeat
    return _balance(model, cost, devices)
