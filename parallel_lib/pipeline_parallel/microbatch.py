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
from torch import Tensor, nn

from parallel_lib.common.checks import positive_int
from parallel_lib.model_parallel.device_map import DeviceMap, get_device_map, validate_device_map
from parallel_lib.pipeline_parallel.stage import TensorOrTensors
from parallel_lib.runtime.device import DeviceKey

__all__ = ["Target", "check_layers", "split_layers", "stage_blocks", "scatter", "gather", "check_split", "split_like", "loss_weights"]

Target = Union[Tensor, Sequence[Tensor]]


def check_layers(module: nn.Sequential) -> None:
    """Refuse a module that holds a layer, or a parameter, twice.

    Stages are cut between layers: a layer in two places would be two stages' at once
    (on two devices, updated by two threads), and a shared parameter would get part of
    its gradient on each stage with nobody summing them. For weights that are one in the
    model but live on two stages, give each stage its own copy and name the pair in
    ``tied_parameters`` (see :func:`~parallel_lib.pipeline_parallel.gpt2.gpt2_stages`).

    Raises:
        ValueError: naming both places.
    """
    first_place: dict[int, str] = {}
    for name, layer in module._modules.items():  # named_children() would skip the repeat
        if id(layer) in first_place:
            raise ValueError(f"module holds the same layer twice (layers {first_place[id(layer)]} and {name}); "
                             "a pipeline stage needs layers of its own: use a copy")
        first_place[id(layer)] = name
    first_place = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first_place:
            raise ValueError(f"module holds the same parameter twice ({first_place[id(param)]} and {name}); give "
                             "each stage its own copy and pass the pair in tied_parameters")
        first_place[id(param)] = name


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
        TypeError: ``devices`` is a single key (an int, a string) instead of a list or a map.
        ValueError: no devices, more stages than layers, a map that does not list the
            layers once each in order, or a stage without layers.
    """
    if isinstance(devices, (str, int, torch.device)) or not isinstance(devices, (dict, Sequence)):
        raise TypeError(f"devices must be a list of device keys (one per stage, e.g. [0, 1] or ['cpu', 'cpu']) "
                        f"or a device map {{device: [layer indices]}}, got devices={devices!r}")
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


def stage_blocks(n_layer: int, pp: int) -> list[list[int]]:
    """The block indices of each of ``pp`` pipeline stages: the split every pipeline of the course runs.

    Contiguous and balanced, the first ``n_layer % pp`` stages one block more (:func:`split_layers`'s
    rule, chapter 04's balance). The runtime builds its stages with it (the threaded ``Pipe``, the
    ranks of ``train``) and the planner prices the same stages, so both hold the same blocks.

    Args:
        n_layer: the model's blocks.
        pp: number of stages.

    Returns:
        ``pp`` lists of block indices, e.g. ``stage_blocks(5, 2) == [[0, 1, 2], [3, 4]]``.

    Raises:
        ValueError: ``n_layer`` or ``pp`` below 1, or more stages than blocks.
    """
    positive_int("n_layer", n_layer)
    positive_int("pp", pp)
    if pp > n_layer:
        raise ValueError(f"pp={pp} stages need at least {pp} blocks, the model has n_layer={n_layer}; "
                         f"use pp <= {n_layer}")
    return split_layers(n_layer, ["cpu"] * pp, "blocks")[1]


def scatter(batch: TensorOrTensors, chunks: Optional[int] = None,
            split_size: Optional[int] = None) -> list[TensorOrTensors]:
    """Split ``batch`` (a tensor or a tuple of tensors with the same rows) along dim 0 into micro-batches.

    Args:
        batch: the input, at least one dimension.
        chunks: number of micro-batches; sizes differ by at most one, larger ones first. A
            batch with fewer rows (the last, short batch of an epoch) gets one micro-batch
            per row, as in torchgpipe.
        split_size: rows per micro-batch instead (the last one may be smaller).

    Returns:
        The micro-batches, views of ``batch`` (tuples for a tuple).

    Raises:
        TypeError: ``batch`` is not a tensor or a tuple of tensors with a batch dimension.
        ValueError: both or neither of ``chunks``/``split_size``, a value below 1, an empty
            batch, or tensors of a tuple with different numbers of rows.
    """
    tensors = batch if isinstance(batch, tuple) else (batch,)
    if not tensors or not all(isinstance(t, Tensor) and t.dim() > 0 for t in tensors):
        raise TypeError(f"batch must be a tensor, or a tuple of tensors, with a batch dimension, got "
                        f"{type(batch).__name__}")
    check_split(chunks, split_size)
    rows = {t.size(0) for t in tensors}
    if len(rows) > 1 or 0 in rows:
        raise ValueError(f"batch must hold at least one row, the same number in every tensor, got rows "
                         f"{[t.size(0) for t in tensors]}")
    if split_size is not None:
        parts = [torch.split(t, split_size) for t in tensors]
    else:
        n = min(chunks, rows.pop())  # type: ignore[type-var]
        parts = [torch.tensor_split(t, n) for t in tensors]
    if isinstance(batch, Tensor):
        return list(parts[0])
    return [tuple(p[i] for p in parts) for i in range(len(parts[0]))]


def gather(outputs: Sequence[TensorOrTensors]) -> TensorOrTensors:
    """Concatenate the micro-batches' outputs along dim 0 (position by position for tuples)."""
    if isinstance(outputs[0], Tensor):
        return torch.cat(list(outputs))  # type: ignore[arg-type]
    return tuple(torch.cat([out[k] for out in outputs]) for k in range(len(outputs[0])))  # type: ignore[index]


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
