"""Splitting a model into stages, a batch into micro-batches, and weighting their losses.

The loss of a batch is usually a *mean* over its rows. A pipeline computes one
loss per micro-batch, so to get the gradients of the full-batch loss each
micro-batch loss is weighted by its share of the rows, ``n_i / N``: with a batch of
10 in 3 micro-batches (4, 3, 3) the weights are 0.4, 0.3, 0.3, not 1/3 each. A
loss that is a *sum* over rows needs weight 1 per micro-batch instead.
"""

from __future__ import annotations

from typing import Literal, Optional, Sequence, Union

import torch
from torch import Tensor

from parallel_lib.common.checks import positive_int
from parallel_lib.model_parallel.device_map import DeviceMap, get_device_map, validate_device_map
from parallel_lib.runtime.device import DeviceKey

__all__ = ["Target", "split_layers", "scatter", "check_split", "split_like", "loss_weights"]

Target = Union[Tensor, Sequence[Tensor]]


def split_layers(n_layers: int, devices: Union[Sequence[DeviceKey], DeviceMap],
                 what: str) -> tuple[list[DeviceKey], list[list[int]]]:
    """Device key and layer indices of every stage, from a device list or a device map.

    A list gives one stage per entry, with contiguous balanced layer blocks as
    :func:`~parallel_lib.model_parallel.device_map.get_device_map` makes them; unlike a map's keys,
    entries may repeat (``["cpu", "cpu"]``: two stages sharing the CPU).

    Args:
        n_layers: number of layers to place.
        devices: device keys, one per stage, or a map ``{device: [layer indices]}``.
        what: the name of the layers in error messages ("layers", "blocks").

    Raises:
        ValueError: no devices, more stages than layers, a map that does not list the
            layers once each in order, or a stage without layers.
    """
    if isinstance(devices, dict):
        validate_device_map(devices, n_layers)
        keys, layers = list(devices), [list(v) for v in devices.values()]
    else:
        keys = list(devices)
        if not keys:
            raise ValueError("devices must name at least one device, got devices=[]; e.g. devices=[0, 1]")
        if len(keys) > n_layers:
            raise ValueError(f"devices asks for {len(keys)} stages but there are only {n_layers} {what} "
                             f"(devices={keys!r}); use at most {n_layers} devices")
        layers = list(get_device_map(n_layers, list(range(len(keys)))).values())
    empty = [key for key, stage in zip(keys, layers) if not stage]
    if empty:
        raise ValueError(f"devices gives no {what} to {empty}: every stage needs at least one, "
                         f"got devices={devices!r}")
    return keys, layers


def scatter(batch: Tensor, chunks: Optional[int] = None, split_size: Optional[int] = None) -> list[Tensor]:
    """Split ``batch`` along dim 0 into micro-batches.

    Args:
        batch: the input, at least one dimension.
        chunks: number of micro-batches; sizes differ by at most one, larger ones first.
        split_size: rows per micro-batch instead (the last one may be smaller).

    Returns:
        The micro-batches, views of ``batch``.

    Raises:
        TypeError: ``batch`` is not a tensor.
        ValueError: both or neither of ``chunks``/``split_size``, a value below 1, or a
            batch with fewer rows than ``chunks``.
    """
    if not isinstance(batch, Tensor) or batch.dim() == 0:
        raise TypeError(f"batch must be a tensor with a batch dimension, got {type(batch).__name__}")
    check_split(chunks, split_size)
    rows = batch.size(0)
    if split_size is not None:
        return list(torch.split(batch, split_size))
    if rows < chunks:
        raise ValueError(f"a batch of {rows} rows cannot be split into chunks={chunks} micro-batches; "
                         "use a larger batch or fewer chunks")
    return list(torch.tensor_split(batch, chunks))


def check_split(chunks: Optional[int], split_size: Optional[int]) -> None:
    """Check that exactly one of ``chunks`` and ``split_size`` is given, as an int >= 1.

    Raises:
        ValueError: naming the argument and its value.
    """
    if (chunks is None) == (split_size is None):
        raise ValueError(f"give exactly one of chunks or split_size, got chunks={chunks!r} "
                         f"split_size={split_size!r}")
    name, value = ("chunks", chunks) if split_size is None else ("split_size", split_size)
    positive_int(name, value)


def split_like(target: Target, sizes: Sequence[int]) -> list[Target]:
    """Split a target (a tensor or a tuple of tensors) into micro-batches of ``sizes`` rows.

    Raises:
        ValueError: a target tensor whose rows differ from ``sum(sizes)``.
    """
    tensors = [target] if isinstance(target, Tensor) else list(target)
    for t in tensors:
        if not isinstance(t, Tensor) or t.dim() == 0 or t.size(0) != sum(sizes):
            shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"target must be tensors with {sum(sizes)} rows like the batch, got {shape}")
    parts = [torch.split(t, list(sizes)) for t in tensors]
    if isinstance(target, Tensor):
        return list(parts[0])
    return [tuple(p[i] for p in parts) for i in range(len(sizes))]


def loss_weights(sizes: Sequence[int], reduction: Literal["mean", "sum"] = "mean") -> list[float]:
    """Weight of each micro-batch's loss so that their weighted sum is the full-batch loss.

    Args:
        sizes: rows per micro-batch.
        reduction: "mean" if ``loss_fn`` averages over rows (weights ``n_i / N``),
            "sum" if it sums over rows (weights 1).

    Raises:
        ValueError: an unknown reduction.
    """
    if reduction == "mean":
        total = sum(sizes)
        return [n / total for n in sizes]
    if reduction == "sum":
        return [1.0] * len(sizes)
    raise ValueError(f"reduction must be 'mean' or 'sum', got reduction={reduction!r}")
