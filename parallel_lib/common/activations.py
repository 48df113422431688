"""Activation memory of a training step, measured: recomputation on or off, micro-batches accumulated.

:func:`measure_step_activations` runs forward and backward of a Hugging Face model over
micro-batches and reports the largest micro-batch's activations, counted by the tensor census
of saved tensors (:class:`~parallel_lib.common.saved_tensors.SavedTensors`), and the time;
:func:`set_recomputation` turns the blocks' activation recomputation on or off.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from parallel_lib.common.saved_tensors import SavedTensors

__all__ = ["set_recomputation", "ActivationStep", "measure_step_activations"]


def set_recomputation(model: nn.Module, enabled: bool = True) -> None:
    """Turn activation recomputation of a Hugging Face model's blocks on or off.

    With it on, each transformer block keeps only its input during forward and runs its forward
    again inside backward (``torch.utils.checkpoint``). The re-entrant variant is used so the
    block inputs it keeps pass through autograd's saved-tensor hooks, where :class:`~parallel_lib.common.saved_tensors.SavedTensors`
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
