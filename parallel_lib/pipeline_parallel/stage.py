"""One stage of a pipeline, cut out of the autograd graph: the runner both executors share.

The threaded :class:`~parallel_lib.pipeline_parallel.Pipe` (chapter 04) and the ranks of
:mod:`parallel_lib.hybrid` (chapter 05) run a stage the same way; only the hand-over
differs (a Python object between threads, a message between processes)::

    stage j-1                         stage j (this runner)
    y = f(x) -- y.detach() ---> [1] leaf = input.detach().requires_grad_()
                                [2] z = g(cut(leaf))          forward(i)
    backward(y, leaf.grad) <--- [3] backward(z, grad_z) fills leaf.grad
                                                              backward(i)

[1] The input arrives detached, so stage j's backward is a task of its own and does not
    run on into stage j-1's graph (for CPU tensors autograd runs one ``backward`` call on
    the calling thread, so one call over all stages would run them one after another).
[2] ``cut`` is an identity autograd function whose output shares the leaf's memory but is
    not a leaf, so an in-place first layer (``nn.ReLU(inplace=True)``) works, exactly as in
    the unsplit model. A leaf that requires grad may not be changed in place; a copy would
    cost one activation per micro-batch.
[3] The gradient of the stage's input is the leaf's ``.grad``, handed to stage j-1.

Inputs and outputs are a tensor or a tuple of tensors (hidden states plus a mask, as
torchgpipe allows); tensors that are not floating point (masks, token ids) travel along
without gradients.

Devices. The input is moved to the stage's device on the stage's own thread with
``Tensor.to``. Between two GPUs PyTorch runs that copy on the source device's current
stream after making it wait for the destination's current stream, and makes the
destination's current stream wait for the copy (ATen's ``copy_device_to_device``), so the
consumer's kernels never read a half-copied tensor and the producer's memory is not reused
early. Every stage thread uses its device's default stream, so the default stream is
enough for correctness. What it costs: the copy runs in line with the producing stage's
kernels instead of on a side stream as in torchgpipe, so a copy does not overlap the
producer's next micro-batch. For the course's activation sizes (MBs over NVLink or PCIe,
well under a millisecond) that is a small share of a stage's time.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
from torch import Tensor, nn

__all__ = ["TensorOrTensors", "Saved", "StageRunner", "as_tuple", "like", "cut"]

TensorOrTensors = Union[Tensor, tuple[Tensor, ...]]
Saved = tuple[TensorOrTensors, tuple[Tensor, ...]]  # (input leaves, outputs or loss), kept for backward


def as_tuple(x: TensorOrTensors) -> tuple[Tensor, ...]:
    """``x`` as a tuple of tensors.

    Raises:
        TypeError: ``x`` is neither a tensor nor a tuple of tensors.
    """
    tensors = (x,) if isinstance(x, Tensor) else x
    if not isinstance(tensors, tuple) or not all(isinstance(t, Tensor) for t in tensors):
        raise TypeError(f"a stage's input and output must be a tensor or a tuple of tensors, got "
                        f"{type(x).__name__}")
    return tensors


def like(template: TensorOrTensors, tensors: tuple[Tensor, ...]) -> TensorOrTensors:
    """``tensors`` shaped like ``template``: one tensor for a tensor, the tuple for a tuple."""
    return tensors[0] if isinstance(template, Tensor) else tensors


def _moved(x: TensorOrTensors, device: torch.device) -> TensorOrTensors:
    return like(x, tuple(t.to(device) for t in as_tuple(x)))


class _Cut(torch.autograd.Function):
    """Identity whose output is not a leaf but shares the input's memory [2]."""

    @staticmethod
    def forward(ctx: object, leaf: Tensor) -> Tensor:  # type: ignore[override]
        return leaf.detach()

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad


def cut(x: TensorOrTensors, device: torch.device) -> tuple[tuple[Tensor, ...], TensorOrTensors]:
    """Move ``x`` to ``device`` and cut it from its graph: ``(leaves, what the stage computes on)``."""
    leaves = tuple(t.to(device).detach().requires_grad_(t.is_floating_point()) for t in as_tuple(x))  # [1]
    inputs = tuple(_Cut.apply(t) if t.requires_grad else t for t in leaves)  # [2]
    return leaves, like(x, inputs)


class StageRunner:
    """Forward and backward of one stage on its device, for one micro-batch at a time.

    Args:
        module: the stage's layers (in an ``nn.Sequential`` a tuple reaches the next layer whole).
        device: the stage's device; inputs are moved there.
        first: the first stage: its input (the batch) needs no gradient and is not cut.

    Example (one micro-batch through two runners, no threads)::

        saved0, y = first.forward(x)                 # y: detached, handed to stage 1
        saved1, loss = last.forward(y, loss=fn)      # loss: detached
        grad = last.backward(saved1, None)           # gradient of stage 1's input
        first.backward(saved0, grad)                 # parameters' .grad of both stages filled
    """

    def __init__(self, module: nn.Module, device: torch.device, first: bool) -> None:
        self.module, self.device, self.first = module, device, first

    def run(self, x: TensorOrTensors) -> TensorOrTensors:
        """The stage on ``x`` without cutting: with grad on, the output stays attached to ``x``'s graph."""
        return self.module(_moved(x, self.device))

    def forward(self, x: TensorOrTensors, loss: Optional[Callable[[TensorOrTensors], Tensor]] = None
                ) -> tuple[Saved, TensorOrTensors]:
        """Run the stage for training: ``(saved for backward, detached output or loss)``.

        Args:
            x: the stage's input (the previous stage's detached output, or the batch).
            loss: on the last stage, maps the output to the micro-batch's (weighted) loss.
        """
        if self.first:
            leaves, inputs = (), _moved(x, self.device)
        else:
            leaves, inputs = cut(x, self.device)
        y = self.module(inputs)
        if loss is not None:
            y = loss(y)
        outputs = as_tuple(y)
        return (like(x, leaves) if leaves else (), outputs), like(y, tuple(t.detach() for t in outputs))

    def backward(self, saved: Saved, grad: Optional[TensorOrTensors]) -> Optional[TensorOrTensors]:
        """Backward of the stage [3]: the gradient of its input (None on the first stage).

        Args:
            saved: what :meth:`forward` returned first.
            grad: the gradient of the output (None for a loss); outputs whose gradient is None,
                or that do not require grad, are left out, as autograd does for unused outputs.
        """
        leaves, outputs = saved
        grads = grad if isinstance(grad, tuple) else (grad,) * len(outputs)  # None for inputs without grad
        pairs = [(y, None if g is None else g.to(y.device)) for y, g in zip(outputs, grads)
                 if y.requires_grad and (g is not None or grad is None)]
        if pairs:  # a parameter-free first stage has nothing to differentiate
            torch.autograd.backward([y for y, _ in pairs], [g for _, g in pairs])
        if self.first:
            return None
        return like(leaves, tuple(leaf.grad for leaf in as_tuple(leaves)))
