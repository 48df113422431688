"""What the chapters' GPU checks share: the workload, the one-device reference, the comparison, freeing memory.

The in-process checks (chapters 03, 04, 08) train GPT-2 on batches of the built-in corpus and
compare the loss and every gradient with one device (:func:`one_device_reference`,
:func:`max_difference`); a check whose result is wrong raises :class:`CheckError`. Every check
frees cached GPU memory when it ends (:func:`free_memory`), since the next one may launch ranks.
"""

from __future__ import annotations

import copy
import gc
import math
from dataclasses import dataclass

import torch
from torch import nn

from parallel_lib.common.compare import max_abs_difference
from parallel_lib.common.models import build_gpt2
from parallel_lib.common.training import forward_loss
from parallel_lib.data.corpus import load_corpus
from parallel_lib.data.tokenizer import collate_batch, get_tokenizer
from parallel_lib.runtime.device import resolve_device

__all__ = ["CheckError", "Workload", "FULL", "QUICK", "Batch", "Grads", "TOLERANCE", "workload_for", "device_counts",
           "grads_of", "loss_and_grads", "one_device_reference", "max_difference", "free_memory"]

Batch = dict[str, torch.Tensor]
Grads = tuple[torch.Tensor, dict[str, torch.Tensor]]  # (loss, gradient or parameter by name), on the CPU

# one forward/backward on other devices vs one device: the same kernels, summed in another order
TOLERANCE = dict(rtol=1e-4, atol=1e-5)


class CheckError(RuntimeError):
    """A check ran but its result is wrong (e.g. split training differs from one device)."""


@dataclass(frozen=True)
class Workload:
    """The model and batches of the in-process checks (model parallel, pipeline)."""

    model: str = "gpt2"                # a GPT2_SIZES name; "gpt2" is the 124M shape
    rows: int = 32                     # rows per batch
    length: int = 128                  # positions per row, every row padded to it
    steps: int = 10                    # training steps timed per device map, after one warm-up
    repeats: int = 4                   # pipeline steps timed per micro-batch count, after one warm-up
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    vocab_size: int = 2048


FULL = Workload()
QUICK = Workload(model="tiny", rows=8, length=32, steps=3, repeats=2, micro_batches=(1, 2, 4), vocab_size=300)


def workload_for(quick: bool) -> Workload:
    """The quick or the full workload."""
    return QUICK if quick else FULL


def device_counts(n_devices: int, n_layers: int) -> list[int]:
    """How many devices to split a model over: 1, 2, 4, ... and all of them (at most one per layer)."""
    most = min(n_devices, n_layers)
    return sorted({k for k in (2**i for i in range(most.bit_length())) if k <= most} | {most})


def _batches(workload: Workload) -> tuple[int, list[Batch]]:
    """(vocabulary size, ``steps + 1`` batches of ``rows`` x ``length`` from the built-in corpus)."""
    pairs = load_corpus("train", size=workload.rows * (workload.steps + 1))
    tokenizer = get_tokenizer(pairs, vocab_size=workload.vocab_size)
    return len(tokenizer), [collate_batch(pairs[i:i + workload.rows], "de", "en", tokenizer, workload.length,
                                          pad_to_max_length=True) for i in range(0, len(pairs), workload.rows)]


def grads_of(model: nn.Module, loss: torch.Tensor) -> Grads:
    """``(loss, {name: gradient})`` of ``model``, detached and on the CPU, for :func:`max_difference`."""
    return loss.detach().cpu(), {name: p.grad.detach().cpu() for name, p in model.named_parameters()
                                 if p.grad is not None}


def loss_and_grads(model: nn.Module, batch: Batch, device: torch.device) -> Grads:
    """One forward and backward of ``model`` on ``batch`` (moved to ``device``)."""
    model.zero_grad(set_to_none=True)
    loss = forward_loss(model, {k: v.to(device) for k, v in batch.items()})
    loss.backward()
    return grads_of(model, loss)


def one_device_reference(workload: Workload) -> tuple[list[Batch], nn.Module, Grads]:
    """The batches, the one-device GPT-2 every split is compared with, and its gradients on ``cuda:0``."""
    vocab_size, batches = _batches(workload)
    reference = build_gpt2(workload.model, vocab_size=vocab_size)
    first = resolve_device(0)
    return batches, reference, loss_and_grads(copy.deepcopy(reference).to(first), batches[0], first)


def max_difference(expected: Grads, got: Grads, what: str) -> float:
    """Largest |difference| of the loss and the named tensors; raises ``CheckError`` if one is off or not finite."""
    try:
        torch.testing.assert_close(got[0], expected[0], **TOLERANCE, msg=lambda m: f"loss: {m}")
        assert got[1].keys() == expected[1].keys(), "the parameter names differ"
        for name, grad in expected[1].items():
            torch.testing.assert_close(got[1][name], grad, **TOLERANCE, msg=lambda m: f"{name}: {m}")
    except AssertionError as e:
        raise CheckError(f"{what} does not match the reference: {e}") from None
    worst = max([max_abs_difference(got[0], expected[0])]
                + [max_abs_difference(got[1][name], grad) for name, grad in expected[1].items()])
    if math.isinf(worst):  # assert_close lets inf == inf pass
        raise CheckError(f"{what}: a loss or gradient is infinite here and in the reference: not a match")
    return worst


def free_memory() -> None:
    """Give cached GPU memory back between checks (the next one may launch processes)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
