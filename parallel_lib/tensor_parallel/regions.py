"""The conjugate collectives of tensor parallelism, as autograd functions.

Megatron-LM (Shoeybi et al. 2019, section 3) needs only two operators to split a
transformer layer across the ranks of a tensor-parallel group:

==========================  ======================  ======================
operator                    forward                 backward
==========================  ======================  ======================
``f`` copy to TP region     identity                all-reduce
``g`` reduce from TP region all-reduce              identity
==========================  ======================  ======================

Each is the other's transpose: ``f`` copies one activation to every rank, so the
gradients that come back from the ranks must be summed; ``g`` sums partial results,
so the gradient of a sum reaches every summand unchanged.

Sequence parallelism (Korthikanti et al. 2022) splits the all-reduce into its two
halves, around the layer norms and dropouts that then run on a slice of the sequence:

==========================================  ==============  ==============
operator                                    forward         backward
==========================================  ==============  ==============
gather from the SP region (before column)   all-gather      reduce-scatter
reduce-scatter to the SP region (after row) reduce-scatter  all-gather
scatter to the SP region (split a copy)     keep my slice   all-gather
==========================================  ==============  ==============

A column-parallel layer behind the gather (:func:`sequence_parallel_linear`) does as Megatron-LM's
``LinearWithGradAccumulationAndAsyncCommunication``: it keeps for backward only this rank's slice
of its input, not the gathered whole, and gathers it again in backward for the weight's gradient.
One all-gather more per column-parallel layer and step buys ``(t - 1)/t`` of the input's bytes.

Every operator calls ``torch.distributed`` through the module attribute (``dist.x``),
so :func:`parallel_lib.runtime.count_collectives` counts it; and every call is
appended to the active :func:`record_regions` traces, which the chapter's widget replays.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from parallel_lib.runtime.compat import all_gather_single, reduce_scatter_single

__all__ = ["RegionEvent", "record_regions", "group_size", "group_rank", "copy_to_tensor_parallel_region",
           "reduce_from_tensor_parallel_region", "gather_from_tensor_parallel_region",
           "gather_from_sequence_parallel_region", "reduce_scatter_to_sequence_parallel_region",
           "scatter_to_sequence_parallel_region", "sequence_parallel_linear"]

SEQUENCE_DIM = 1  # activations are (batch, sequence, hidden) everywhere in this package


@dataclass(frozen=True)
class RegionEvent:
    """One operator as it ran: which one, in which pass, what it moved, the shapes in and out."""

    op: str          # "f", "g", "gather_tp", "gather_sp", "reduce_scatter_sp", "scatter_sp"
    phase: str       # "forward" or "backward"
    collective: str  # "all_reduce", "all_gather", "reduce_scatter" or "none"
    shape_in: tuple[int, ...]
    shape_out: tuple[int, ...]
    label: str = ""  # the layer that issued it, set by :func:`record_regions`'s ``label``


_traces: list[list[RegionEvent]] = []
_label: list[str] = [""]


@contextmanager
def record_regions() -> Iterator[list[RegionEvent]]:
    """Collect every operator call (forward and backward) made in the block, in order."""
    trace: list[RegionEvent] = []
    _traces.append(trace)
    try:
        yield trace
    finally:
        _traces.remove(trace)


@contextmanager
def region_label(label: str) -> Iterator[None]:
    """Name the layer whose operators run in the block (for the recorded events)."""
    previous, _label[0] = _label[0], label
    try:
        yield
    finally:
        _label[0] = previous


def labelled(label: str) -> Any:
    """:func:`region_label` of ``label``, or nothing (the enclosing label stays) when ``label`` is empty.

    The split layers call it with their ``label`` attribute, which :func:`~.parallelize.parallelize_tp`
    sets to the part of the model they sit in ("embedding", "attention", "mlp", "head").
    """
    return region_label(label) if label else nullcontext()


def _note(ctx: Any, op: str, phase: str, collective: str, x: torch.Tensor, y: torch.Tensor) -> None:
    if phase == "forward":  # the backward is labelled with the layer whose forward it undoes
        ctx.label = _label[0]
    for trace in _traces:
        trace.append(RegionEvent(op, phase, collective, tuple(x.shape), tuple(y.shape), ctx.label))


def group_size(group: Any) -> int:
    """Ranks in ``group`` (1 when torch.distributed is not initialised: a dense run)."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def group_rank(group: Any) -> int:
    """This process's rank within ``group`` (0 when torch.distributed is not initialised)."""
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    if group_size(group) > 1:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
    return x


def _all_gather(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (one all-gather of the whole tensor)."""
    n = group_size(group)
    if n == 1:
        return x
    moved = x.movedim(dim, 0).contiguous()  # the collective concatenates along dim 0
    out = moved.new_empty((n * moved.shape[0],) + tuple(moved.shape[1:]))
    all_gather_single(out, moved, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Sum ``x`` over the ranks and keep this rank's slice along ``dim``."""
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not split over {n} ranks; "
                         f"use a sequence length divisible by the tensor-parallel size")
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // n,) + tuple(moved.shape[1:]))
    reduce_scatter_single(out, moved, group=group)
    return out.movedim(0, dim)


def _split(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """This rank's slice of ``x`` along ``dim`` (no communication)."""
    n = group_size(group)
    if x.shape[dim] % n:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not split over {n} ranks")
    return x.chunk(n, dim)[group_rank(group)].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        _note(ctx, "f", "forward", "none", x, x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = _all_reduce(grad.clone(), ctx.group)
        _note(ctx, "f", "backward", "all_reduce", grad, out)
        return out, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = _all_reduce(x.clone(), group)
        _note(ctx, "g", "forward", "all_reduce", x, out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _note(ctx, "g", "backward", "none", grad, grad)
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last (feature) dimension; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = _all_gather(x, -1, group)
        _note(ctx, "gather_tp", "forward", "all_gather", x, out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = _split(grad, -1, ctx.group)
        _note(ctx, "gather_tp", "backward", "none", grad, out)
        return out, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = _all_gather(x, SEQUENCE_DIM, group)
        _note(ctx, "gather_sp", "forward", "all_gather", x, out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # the gathered tensor feeds a column-parallel layer: each rank's gradient is partial
        out = _reduce_scatter(grad, SEQUENCE_DIM, ctx.group)
        _note(ctx, "gather_sp", "backward", "reduce_scatter", grad, out)
        return out, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = _reduce_scatter(x, SEQUENCE_DIM, group)
        _note(ctx, "reduce_scatter_sp", "forward", "reduce_scatter", x, out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = _all_gather(grad, SEQUENCE_DIM, ctx.group)
        _note(ctx, "reduce_scatter_sp", "backward", "all_gather", grad, out)
        return out, None


class _SequenceParallelLinear(torch.autograd.Function):
    """All-gather the sequence and multiply, keeping only this rank's slice of the input for backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                group: Any) -> torch.Tensor:
        ctx.group, ctx.has_bias = group, bias is not None
        whole = _all_gather(x, SEQUENCE_DIM, group)
        _note(ctx, "gather_sp", "forward", "all_gather", x, whole)
        ctx.save_for_backward(x, weight)  # the slice, not the gathered whole (Megatron's sequence parallelism)
        return torch.nn.functional.linear(whole, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        x, weight = ctx.saved_tensors
        whole = _all_gather(x, SEQUENCE_DIM, ctx.group)  # gathered again, for the weight's gradient
        _note(ctx, "regather_sp", "backward", "all_gather", x, whole)
        grad_whole = grad @ weight  # each rank's share of the input's gradient: partial sums
        grad_x = _reduce_scatter(grad_whole, SEQUENCE_DIM, ctx.group)
        _note(ctx, "gather_sp", "backward", "reduce_scatter", grad_whole, grad_x)
        rows, grad_rows = whole.reshape(-1, whole.shape[-1]), grad.reshape(-1, grad.shape[-1])
        grad_weight = grad_rows.t() @ rows
        grad_bias = grad_rows.sum(0) if ctx.has_bias else None
        return grad_x, grad_weight, grad_bias, None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = _split(x, SEQUENCE_DIM, group)
        _note(ctx, "scatter_sp", "forward", "none", x, out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = _all_gather(grad, SEQUENCE_DIM, ctx.group)
        _note(ctx, "scatter_sp", "backward", "all_gather", grad, out)
        return out, None


def copy_to_tensor_parallel_region(x: torch.Tensor, group: Optional[Any] = None) -> torch.Tensor:
    """``f``: identity forward, all-reduce of the gradient backward."""
    return _CopyToTP.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: Optional[Any] = None) -> torch.Tensor:
    """``g``: all-reduce (sum) forward, identity backward."""
    return _ReduceFromTP.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group: Optional[Any] = None) -> torch.Tensor:
    """All-gather of the last dimension forward, this rank's slice of the gradient backward."""
    return _GatherFromTP.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: Optional[Any] = None) -> torch.Tensor:
    """All-gather along the sequence forward, reduce-scatter of the gradient backward."""
    return _GatherFromSP.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Optional[Any] = None) -> torch.Tensor:
    """Reduce-scatter along the sequence forward, all-gather of the gradient backward."""
    return _ReduceScatterToSP.apply(x, group)


def sequence_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                             group: Optional[Any] = None) -> torch.Tensor:
    """``linear(gather_from_sequence_parallel_region(x), weight, bias)``, keeping only ``x`` (the slice) for backward.

    Args:
        x: this rank's slice of the sequence, (b, s/t, in).
        weight: this rank's rows of the column-parallel weight, (out/t, in); bias: (out/t,) or None.
        group: the tensor-parallel group (None: the default group).

    Returns:
        (b, s, out/t): this rank's output features over the whole sequence. In backward the slice is
        all-gathered again for the weight's gradient, and the input's gradient reduce-scattered.
    """
    return _SequenceParallelLinear.apply(x, weight, bias, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Optional[Any] = None) -> torch.Tensor:
    """Keep this rank's slice of the sequence forward, all-gather of the gradient backward."""
    return _ScatterToSP.apply(x, group)
