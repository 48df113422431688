"""Activation memory, counted: the bytes autograd keeps for the backward pass.

Process RSS on a CPU counts everything (the interpreter, torch's caches, the data), and
``torch.cuda.max_memory_allocated`` exists only on GPUs. What training memory formulas call
"activations" is exactly what autograd saves during forward to use in backward, and autograd
lets us see each of those tensors as it is saved (``torch.autograd.graph.saved_tensors_hooks``).
:class:`SavedTensors` adds up their storages, each storage once, leaving out the parameters
(saved by every matrix multiply for the input gradient, but counted as weights, not
activations). The same count on any device, exact to the byte.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch
from torch import nn

__all__ = ["SavedTensors", "set_recomputation", "ActivationStep", "measure_step_activations"]


class SavedTensors:
    """Context manager: bytes of the tensors autograd saves for backward inside the block.

    Example::

        with SavedTensors(model) as saved:
            loss = model(input_ids=ids, labels=ids).loss
        print(saved.nbytes)  # activations held until loss.backward()

    Args:
        exclude: modules or parameters whose storages are not activations (usually the model).

    Attributes:
        nbytes: bytes of distinct storages saved (views of one storage count once).
        count: number of tensors saved (a storage saved twice counts twice here).
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
            self._excluded.update(t.untyped_storage().data_ptr() for t in tensors)
        self._storages: dict[int, int] = {}
        self.count = 0
        self._hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None

    @property
    def nbytes(self) -> int:
        return sum(self._storages.values())

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._excluded:
            self._storages[storage.data_ptr()] = storage.nbytes()
            self.count += 1
        return tensor

    def __enter__(self) -> "SavedTensors":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc)
        self._hooks = None


def set_recomputation(model: nn.Module, enabled: bool = True) -> None:
    """Turn activation recomputation of a Hugging Face model's blocks on or off.

    With it on, each transformer block keeps only its input during forward and runs its forward
    again inside backward (``torch.utils.checkpoint``). The re-entrant variant is used so the
    block inputs it keeps pass through autograd's saved-tensor hooks, where :class:`SavedTensors`
    counts them (the non-re-entrant one keeps them out of sight of an outer hook).
    """
    if not hasattr(model, "gradient_checkpointing_enable"):
        raise TypeError(f"model must be a Hugging Face PreTrainedModel, got {type(model).__name__}")
    with warnings.catch_warnings():  # newer transformers renamed the two methods; both names work
        warnings.simplefilter("ignore", FutureWarning)
        if enabled:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        else:
            model.gradient_checkpointing_disable()


@dataclass(frozen=True)
class ActivationStep:
    """One training step's activation memory and time (see :func:`measure_step_activations`)."""

    saved_bytes: int  # the largest micro-batch's saved tensors: what is live at the peak
    seconds: float  # forward and backward of every micro-batch
    loss: float  # mean of the micro-batches' losses


def measure_step_activations(model: nn.Module, micro_batches: Sequence[torch.Tensor],
                             recompute: bool = False) -> ActivationStep:
    """Forward and backward of ``micro_batches`` (token ids, equal shapes) with gradient accumulation.

    Each micro-batch's loss is divided by their number, so the accumulated gradients are those of
    one step on all of them together (the micro-batches hold no padding, so every one has as many
    tokens as the others). Gradients are left in ``.grad`` for the caller to compare or step.

    Raises:
        ValueError: no micro-batches, or micro-batches of different shapes.
    """
    if not micro_batches:
        raise ValueError("micro_batches must hold at least one batch of token ids")
    if len({tuple(ids.shape) for ids in micro_batches}) != 1:
        raise ValueError(f"micro_batches must have equal shapes, got {[tuple(ids.shape) for ids in micro_batches]}")
    set_recomputation(model, recompute)
    model.train()
    model.zero_grad(set_to_none=True)
    peak, total = 0, 0.0
    start = time.perf_counter()
    for ids in micro_batches:
        with SavedTensors(model) as saved:
            loss = model(input_ids=ids, labels=ids).loss / len(micro_batches)
        peak = max(peak, saved.nbytes)
        loss.backward()
        total += loss.item()
    return ActivationStep(peak, time.perf_counter() - start, total)
