"""The tensor census of activations: the bytes autograd keeps for the backward pass, counted as it saves them.

Process RSS on a CPU counts everything (the interpreter, torch's caches, the data), and
``torch.cuda.max_memory_allocated`` exists only on GPUs. What training memory formulas call
"activations" is exactly what autograd saves during forward to use in backward, and autograd
lets us see each of those tensors as it is saved (``torch.autograd.graph.saved_tensors_hooks``).
:class:`SavedTensors` is the course's one counter of them: every chapter that measures activation
memory (03's recomputation, 04's and 08's stages, 07's tensor-parallel block, 11's attention)
reads it, so their numbers mean the same thing. The same count on any device, exact to the byte.

What counts. Memory is held by *storages*; a saved tensor may be a view of one. Each storage
counts once, with the bytes its saved views reach (the union of their address ranges): a whole
tensor saved twice, or split into views that are all saved (q, k and v of one projection), counts
its storage; a slice (one micro-batch of a batch, one chunk of a sequence) counts the slice, since
the rest belongs to its owner. Storages of excluded tensors (the parameters and buffers of the
model: weights, not activations, though every matrix multiply saves its weight) are left out. A
DTensor counts its local shard.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

__all__ = ["SavedTensors"]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor holding the bytes: a DTensor's local shard, or the tensor itself."""
    return getattr(tensor, "_local_tensor", tensor)


def _byte_range(tensor: torch.Tensor) -> tuple[int, int]:
    """``[start, end)`` in bytes of the part of its storage a (possibly strided) tensor reaches."""
    item = tensor.element_size()
    start = tensor.storage_offset() * item
    if tensor.numel() == 0:
        return start, start
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return start, start + (last + 1) * item


def _union(ranges: list[tuple[int, int]]) -> int:
    """Bytes covered by a list of ``[start, end)`` ranges."""
    total, reached = 0, None
    for start, end in sorted(ranges):
        if reached is None or start >= reached:
            total, reached = total + end - start, end
        elif end > reached:
            total, reached = total + end - reached, end
    return total


class SavedTensors:
    """Context manager: bytes of the tensors autograd saves for backward inside the block.

    Example::

        with SavedTensors(model) as saved:
            loss = model(input_ids=ids, labels=ids).loss
        print(saved.nbytes)  # activations held until loss.backward()

    Args:
        exclude: modules (their parameters and buffers) or tensors whose storages are not activations,
            usually the model; a DTensor stands for its local shard.

    Attributes:
        nbytes: bytes of the storages saved, each once, as far as its saved views reach (module docstring).
        count: number of tensors saved (a tensor saved twice counts twice here).

    Raises:
        TypeError: ``exclude`` holds something other than modules and tensors.
    """

    def __init__(self, exclude: Optional[Iterable[nn.Module | torch.Tensor] | nn.Module] = None):
        if isinstance(exclude, nn.Module):
            exclude = [exclude]
        self._excluded: set[int] = set()
        for item in exclude or ():
            if isinstance(item, nn.Module):
                tensors = list(item.parameters()) + list(item.buffers())
            elif isinstance(item, torch.Tensor):
                tensors = [item]
            else:
                raise TypeError(f"exclude must hold modules or tensors, got {type(item).__name__}")
            self._excluded.update(_local(t).untyped_storage().data_ptr() for t in tensors)
        self._ranges: dict[int, list[tuple[int, int]]] = {}
        self.count = 0
        self._hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None

    @property
    def nbytes(self) -> int:
        return sum(_union(ranges) for ranges in self._ranges.values())

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        local = _local(tensor)
        storage = local.untyped_storage().data_ptr()
        if storage not in self._excluded:
            self._ranges.setdefault(storage, []).append(_byte_range(local))
            self.count += 1
        return tensor

    def __enter__(self) -> SavedTensors:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc)
        self._hooks = None
