"""One stage of a pipeline, cut out of the autograd graph: the runner both executors share.

The threaded :class:`~parallel_lib.pipeline_parallel.Pipe` (chapter 04) and the ranks of the one
training entry :func:`parallel_lib.training.train` (chapters 05-10) run a stage the same way; only the hand-over
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

Recomputation (``forward(..., recompute=True)``) keeps only the input and runs the forward again
at backward time, from the random-number state saved when the forward started (the CPU
generator's and the stage's GPU's, as torchgpipe saves them per micro-batch), so dropout draws
the same masks twice and the gradients belong to the forward whose output was handed on.

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

import contextlib
from typing import Any, Callable, ContextManager, Optional, Union

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from parallel_lib.common.saved_tensors import SavedTensors
from parallel_lib.pipeline_parallel.weight_grad import add_gradients, record_weight_ops, weight_gradients

__all__ = ["TensorOrTensors", "Saved", "StageRunner", "RngState", "as_tuple", "like", "cut", "move_stage",
           "save_rng", "replayed_rng"]

TensorOrTensors = Union[Tensor, tuple[Tensor, ...]]
# (input leaves, outputs or loss, recorded operations or None), or ("recompute", input, loss, rng, split)
Saved = tuple[Any, ...]


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


def move_stage(module: nn.Module, device: torch.device) -> nn.Module:
    """Move a stage's layers to ``device`` keeping every parameter object (``torch.utils.swap_tensors``).

    A list that holds a stage's parameters (its tied copies, an optimizer) stays valid whatever the
    devices: a plain ``Module.to`` makes new parameter objects when the tensor types differ (onto
    the meta device, for instance), and the old ones would stay alive where the list keeps them.
    Attributes set on a parameter (tensor parallelism's ``sequence_parallel`` mark) are kept too.
    """
    marks = {id(p): dict(p.__dict__) for p in module.parameters()}  # e.g. ``sequence_parallel``: a swap drops them
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        module.to(device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
    for p in module.parameters():
        p.__dict__.update(marks.get(id(p), {}))
    return module


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


RngState = tuple[Tensor, Optional[Tensor]]  # the CPU generator's state, the stage's CUDA device's (None on a CPU)


def save_rng(device: torch.device) -> RngState:
    """The random-number state a forward on ``device`` starts from: the CPU generator's and, on a GPU, its own.

    Args:
        device: the stage's device.

    Returns:
        ``(CPU state, the GPU's state or None)``, for :func:`replayed_rng`.
    """
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


@contextlib.contextmanager
def replayed_rng(device: torch.device, state: RngState) -> Any:
    """Run the block from ``state`` (see :func:`save_rng`), then give the generators back their current state.

    A recomputed forward draws the same dropout masks as the forward it replays, and the draws of
    the replay take nothing from the generators' sequence (the next forward draws what it would
    have drawn without the recomputation).

    Args:
        device: the stage's device (its GPU's generator is replayed too).
        state: what :func:`save_rng` returned at the forward's start.
    """
    cpu, cuda = state
    with torch.random.fork_rng(devices=[device] if cuda is not None else [], device_type="cuda"):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield


class StageRunner:
    """Forward and backward of one stage on its device, for one micro-batch at a time.

    Args:
        module: the stage's layers (in an ``nn.Sequential`` a tuple reaches the next layer whole).
        device: the stage's device; inputs are moved there.
        first: the first stage: its input (the batch) needs no gradient and is not cut.

    Attributes:
        rng_lock: None, or a lock every forward (and recomputation) of this runner holds: the
            threaded Pipe gives the stages that share a random-number generator (several CPU
            stages, two stages on one GPU) one lock while recomputing, so no other stage draws
            from the generator between a forward's saved state and its draws.

    Hooks. Every forward calls ``module`` itself, so forward (pre-)hooks registered on it fire
    once per micro-batch, and once more when that micro-batch is recomputed at backward time
    (the recomputation calls the module again, as torchgpipe's does).

    Example (one micro-batch through two runners, no threads)::

        saved0, y = first.forward(x)                 # y: detached, handed to stage 1
        saved1, loss = last.forward(y, loss=fn)      # loss: detached
        grad = last.backward(saved1, None)           # gradient of stage 1's input
        first.backward(saved0, grad)                 # parameters' .grad of both stages filled
    """

    def __init__(self, module: nn.Module, device: torch.device, first: bool) -> None:
        self.module, self.device, self.first = module, device, first
        self.rng_lock: Optional[ContextManager[Any]] = None

    def _turn(self) -> ContextManager[Any]:
        return self.rng_lock if self.rng_lock is not None else contextlib.nullcontext()

    def run(self, x: TensorOrTensors, recompute: bool = False) -> TensorOrTensors:
        """The stage on ``x`` without cutting: with grad on, the output stays attached to ``x``'s graph.

        ``recompute`` (with grad on): keep only the input, and run the stage again, from the same
        random-number state, when autograd's backward reaches it (``torch.utils.checkpoint``).
        """
        x = _moved(x, self.device)
        with self._turn():
            if recompute and torch.is_grad_enabled():
                # tensors as arguments of their own: checkpoint saves the RNG state of their CUDA devices;
                # the backward of pipe(x) runs after the step, when no stage thread draws random numbers;
                # no early stop: the recomputation runs the whole module, so its forward hooks fire again
                with torch.utils.checkpoint.set_checkpoint_early_stop(False):
                    return torch.utils.checkpoint.checkpoint(lambda *tensors: self.module(like(x, tensors)),
                                                             *as_tuple(x), use_reentrant=False, preserve_rng_state=True)
            return self.module(x)

    def forward(self, x: TensorOrTensors, loss: Optional[Callable[[TensorOrTensors], Tensor]] = None,
                recompute: bool = False, split: bool = False) -> tuple[Saved, TensorOrTensors]:
        """Run the stage for training: ``(saved for backward, detached output or loss)``.

        Args:
            x: the stage's input (the previous stage's detached output, or the batch).
            loss: on the last stage, maps the output to the micro-batch's (weighted) loss.
            recompute: keep only the input and run the forward again at backward time
                (activation checkpointing): memory of one input instead of every layer's.
            split: its backward will be split into :meth:`backward_input` and :meth:`backward_weight`
                (zero-bubble schedules): record each parameterised operation
                (:class:`~parallel_lib.pipeline_parallel.weight_grad.record_weight_ops`).

        After the call ``self.last_saved_bytes`` holds the bytes autograd saved for backward.
        """
        with self._turn():
            if not recompute:
                return self._forward(x, loss, split)
            rng = save_rng(self.device)  # the state the recomputation replays
            with torch.no_grad():
                y = self.module(_moved(x, self.device))
                y = loss(y) if loss is not None else y
        self.last_saved_bytes = sum(t.numel() * t.element_size() for t in as_tuple(x))
        return ("recompute", x, loss, rng, split), like(y, tuple(t.detach() for t in as_tuple(y)))  # type: ignore

    def _forward(self, x: TensorOrTensors, loss: Optional[Callable[[TensorOrTensors], Tensor]], split: bool
                 ) -> tuple[Saved, TensorOrTensors]:
        if self.first:
            leaves, inputs = (), _moved(x, self.device)
        else:
            leaves, inputs = cut(x, self.device)
        recorder = record_weight_ops() if split else contextlib.nullcontext()
        with SavedTensors(self.module) as counter, recorder:
            y = self.module(inputs)  # through the module's own call, so its hooks fire
            if loss is not None:
                y = loss(y)
        self.last_saved_bytes = counter.nbytes
        outputs = as_tuple(y)
        ops = recorder.ops if isinstance(recorder, record_weight_ops) else None
        saved = (like(x, leaves) if leaves else (), outputs, ops)
        return saved, like(y, tuple(t.detach() for t in outputs))  # type: ignore

    def _redo(self, saved: Any) -> Any:
        """The saved state of a recomputed micro-batch: its forward run again, with grad, from the saved
        random-number state (the same dropout masks as the forward whose loss the step reports)."""
        if not isinstance(saved[0], str):  # ("recompute", input, loss, rng, split) from a checkpointed forward
            return saved
        _, x, loss, rng, split = saved
        with self._turn(), replayed_rng(self.device, rng), torch.enable_grad():
            return self._forward(x, loss, split)[0]

    def backward(self, saved: Saved, grad: Optional[TensorOrTensors]) -> Optional[TensorOrTensors]:
        """Backward of the stage [3]: the gradient of its input (None on the first stage).

        Args:
            saved: what :meth:`forward` returned first.
            grad: the gradient of the output (None for a loss); outputs whose gradient is None,
                or that do not require grad, are left out, as autograd does for unused outputs.
        """
        state = self._redo(saved)
        leaves, outputs, ops = state
        if ops is not None:  # recorded for a split backward: B then W in one go
            grad_x, todo = self.backward_input(state, grad)
            self.backward_weight(todo)
            return grad_x
        pairs = _pairs(outputs, grad)
        if pairs:  # a parameter-free first stage has nothing to differentiate
            torch.autograd.backward([y for y, _ in pairs], [g for _, g in pairs])
        if self.first:
            return None
        return like(leaves, tuple(leaf.grad for leaf in as_tuple(leaves)))

    def backward_input(self, saved: Saved, grad: Optional[TensorOrTensors]) -> tuple[Any, Any]:
        """B of a split backward: ``(gradient of the stage's input, what W needs)``.

        One ``torch.autograd.grad`` from the outputs to the stage's input and to its parameters:
        every recorded operation's node gives only its input gradient and keeps its output
        gradient for W (:mod:`.weight_grad` [1]); a parameter used by an operation that was not
        recorded gets its whole gradient now, which W adds. Nothing is written to ``.grad``.

        Raises:
            ValueError: ``saved`` comes from a forward without ``split=True``.
        """
        leaves, outputs, ops = self._redo(saved)
        if ops is None:
            raise ValueError("backward_input needs a forward run with split=True (its parameterised operations "
                             "recorded); call runner.forward(x, loss, split=True)")
        pairs = _pairs(outputs, grad)
        inputs = [] if self.first else [t for t in as_tuple(leaves) if t.requires_grad]
        params = [p for p in self.module.parameters() if p.requires_grad]
        wanted = inputs + params
        got = (torch.autograd.grad([y for y, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
               if pairs and wanted else [None] * len(wanted))
        grads = dict(zip(map(id, inputs), got[:len(inputs)]))
        early = {p: g for p, g in zip(params, got[len(inputs):]) if g is not None}  # not recorded: whole now
        todo = (ops, early)
        if self.first:
            return None, todo
        return like(leaves, tuple(grads.get(id(t)) for t in as_tuple(leaves))), todo

    def backward_weight(self, todo: Any) -> None:
        """W of a split backward: every recorded operation's weight gradients (:mod:`.weight_grad` [2]),
        plus those B computed already, added to ``.grad``."""
        ops, early = todo
        grads = weight_gradients(ops)
        for p, g in early.items():
            grads[p] = grads[p] + g if p in grads else g
        add_gradients(grads)


def _pairs(outputs: tuple[Tensor, ...], grad: Optional[TensorOrTensors]) -> list[tuple[Tensor, Optional[Tensor]]]:
    grads = grad if isinstance(grad, tuple) else (grad,) * len(outputs)  # None for inputs without grad
    return [(y, None if g is None else g.to(y.device)) for y, g in zip(outputs, grads)
            if y.requires_grad and (g is not None or grad is None)]
