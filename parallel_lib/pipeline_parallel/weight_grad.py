"""The split backward of zero-bubble schedules, cut at each parameterised operation.

A whole backward of a linear layer ``y = x Wᵀ + b`` runs two matrix products: ``dx = dy W``
(the *input* gradient, which the previous stage waits for) and ``dW = dyᵀ x`` (the *weight*
gradient, which nobody waits for until the optimizer step). Zero-bubble schedules (Qi et al.,
2023) run them as two actions: B computes only the input gradients through the stage and keeps,
for every parameterised operation, what its weight gradient needs (the operation's input and
its output gradient); W, later, computes only the weight gradients from them. B + W then costs
what one whole backward costs, plus a fixed cost of Python per operation (at width 32, where the
products cost next to nothing: 10–30 µs per operation for B and W together, and about as much
again for recording in F, on the course's 2-core CPU).

How the cut is made. While F runs, :class:`record_weight_ops` (a ``TorchFunctionMode``) catches
each call of a parameterised operation (``F.linear``, ``torch.addmm`` (GPT-2's ``Conv1D``),
``F.embedding``, ``F.layer_norm``) that takes a parameter, and runs it as one autograd node of
the stage's graph (a custom ``autograd.Function``) whose backward is split::

    stage graph              one caught operation: y = linear(x, W, b)
    ... <- [op node] <-      F:  y from PyTorch's own kernel; the node saves x and W
             |
        B:   [1] dx = dy W  (the product autograd's backward runs for x); keep x, dy and Σ dy
        W:   [2] dW = dyᵀ x  (the product autograd runs for W)
             [3] add dW and Σ dy to W.grad, b.grad

[1] In B the node returns the input gradient, with the very call autograd's backward of the
    operation makes for it (``addmm``'s ``mm`` of the same operands), and hands the operation's
    saved input and its output gradient to a :class:`WeightOp`. Parameter gradients that are
    sums over rows and no product (a linear layer's bias, a layer norm's weight and bias) are
    taken here, while dy is in cache, in the call a whole backward makes (one
    ``native_layer_norm_backward`` gives a layer norm's three gradients); Megatron-LM's deferred
    weight gradients likewise put off only the GEMMs. W adds them. Everything else the stage
    saved is freed by B.
[2] W calls, for each operation, the kernel autograd's backward calls for the weight, on the
    same operands (``mm`` in the weight's own layout, ``embedding_dense_backward``):
    B then W gives the bits of one whole backward (``tests/test_weight_grad.py``). No autograd
    graph is walked in W and no activation backward runs again.
[3] Contributions of one parameter (a tied embedding used twice) are summed first, then added
    to ``.grad`` once, as autograd's ``AccumulateGrad`` does.

A call outside those layouts (a non-contiguous input, ``addmm`` with ``beta``, a frozen bias, autocast)
keeps a small autograd graph of its own (:class:`_GraphOp`): B asks it for the input gradient
only, W for the parameters only, so the split still holds, at one autograd call per operation.
A parameter used by any other operation (``weight[ids]``, ``x @ W``) keeps autograd's ordinary
backward: B computes its gradient (:meth:`~parallel_lib.pipeline_parallel.stage.StageRunner.backward_input`
asks for it) and W adds it. Only plain ``nn.Parameter``\\ s are caught (a DTensor parameter
keeps the ordinary backward).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

__all__ = ["WEIGHT_OPS", "WeightOp", "record_weight_ops", "weight_gradients", "add_gradients"]

WEIGHT_OPS = (F.linear, torch.addmm, F.embedding, F.layer_norm)  # the operations whose W is cut out
_LAYER_NORM_BACKWARD = torch.ops.aten.native_layer_norm_backward.default
_EMBEDDING_BACKWARD = torch.ops.aten.embedding_dense_backward.default


def _is_parameter(t: Any) -> bool:
    return type(t) is nn.Parameter and t.requires_grad


class WeightOp:
    """One caught operation: what its weight gradients need, kept by B for W.

    Attributes:
        params: the operation's parameters, in the order :meth:`weight_grads` returns their gradients.
        grad: the output gradient B received and W needs (None before B, when no gradient reached
            the operation, or when B took what W needs from it already).
    """

    __slots__ = ("params", "grad")

    def __init__(self, params: list[Tensor]) -> None:
        self.params = params
        self.grad: Optional[Tensor] = None

    def weight_grads(self) -> list[Optional[Tensor]]:
        """W [2]: the parameters' gradients (none if B did not reach the operation); forget what was kept."""
        raise NotImplementedError


class _LinearOp(WeightOp):
    """``F.linear(x, W, b)`` (W of shape (out, in)) or ``torch.addmm(b, x, W)`` (W of shape (in, out))."""

    __slots__ = ("addmm", "x", "bias_grad")

    def __init__(self, params: list[Tensor], addmm: bool) -> None:
        super().__init__(params)
        self.addmm, self.x, self.bias_grad = addmm, None, None

    def weight_grads(self) -> list[Optional[Tensor]]:
        dy, x = self.grad, self.x
        if dy is None or x is None:
            return []
        dy, x = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])  # rows of every leading dimension
        grads: list[Optional[Tensor]] = [x.t().mm(dy) if self.addmm else dy.t().mm(x)]  # in the weight's layout
        if self.bias_grad is not None:
            grads.append(self.bias_grad)
        self.grad = self.x = self.bias_grad = None
        return grads


class _CutLinear(torch.autograd.Function):
    """A linear layer as one node whose backward gives only ``dx = dy W`` and keeps (x, dy, Σ dy) [1]."""

    @staticmethod
    def forward(ctx: Any, op: _LinearOp, x: Tensor, weight: Tensor, bias: Optional[Tensor]  # type: ignore[override]
                ) -> Tensor:
        ctx.op = op
        ctx.save_for_backward(x, weight)
        return torch.addmm(bias, x, weight) if op.addmm else F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        op: _LinearOp = ctx.op
        op.x, op.grad = x, dy
        if len(op.params) == 2:  # the bias gradient, while dy is in cache [1]
            op.bias_grad = dy.reshape(-1, dy.shape[-1]).sum(0)
        dx = None
        if ctx.needs_input_grad[1]:
            dx = dy.mm(weight.t()) if op.addmm else dy.matmul(weight)
        return None, dx, None, None


class _NormOp(WeightOp):
    """``F.layer_norm(x, shape, weight, bias, eps)``."""

    __slots__ = ("shape", "grads")

    def __init__(self, params: list[Tensor], shape: list[int]) -> None:
        super().__init__(params)
        self.shape, self.grads = shape, [None, None]

    def weight_grads(self) -> list[Optional[Tensor]]:
        grads, self.grads = self.grads, [None, None]
        return grads


class _CutNorm(torch.autograd.Function):
    """A layer norm as one node whose backward gives the input gradient and keeps the parameters' [1].

    A layer norm's parameter gradients are sums over rows (no product), and the kernel that gives
    the input gradient reads the same x and dy: one call gives all three, as in a whole backward,
    and W only adds the two it kept (a second call in W would read x and dy again).
    """

    @staticmethod
    def forward(ctx: Any, op: _NormOp, x: Tensor, weight: Tensor, bias: Tensor, eps: float  # type: ignore[override]
                ) -> Tensor:
        y, mean, rstd = torch.native_layer_norm(x, op.shape, weight, bias, eps)
        ctx.op = op
        ctx.save_for_backward(x, weight, bias, mean, rstd)  # what autograd's own node saves
        return y

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        x, weight, bias, mean, rstd = ctx.saved_tensors
        op: _NormOp = ctx.op
        dx, dw, db = _LAYER_NORM_BACKWARD(dy, x, op.shape, mean, rstd, weight, bias,
                                          [ctx.needs_input_grad[1], True, True])
        op.grads = [dw, db]  # dy is not kept
        return None, dx, None, None, None


class _EmbeddingOp(WeightOp):
    """``F.embedding(ids, weight, padding_idx, scale_grad_by_freq=...)`` (dense, no renormalisation)."""

    __slots__ = ("ids", "padding_idx", "scale")

    def __init__(self, params: list[Tensor], padding_idx: int, scale: bool) -> None:
        super().__init__(params)
        self.ids: Optional[Tensor] = None
        self.padding_idx, self.scale = padding_idx, scale

    def weight_grads(self) -> list[Optional[Tensor]]:
        if self.grad is None:
            return []
        grad = _EMBEDDING_BACKWARD(self.grad, self.ids, self.params[0].shape[0], self.padding_idx, self.scale)
        self.grad = self.ids = None  # type: ignore[assignment]
        return [grad]


class _CutEmbedding(torch.autograd.Function):
    """An embedding as one node whose backward keeps dy (the token ids have no gradient) [1]."""

    @staticmethod
    def forward(ctx: Any, op: _EmbeddingOp, ids: Tensor, weight: Tensor) -> Tensor:  # type: ignore[override]
        ctx.op = op
        ctx.save_for_backward(ids)
        return torch.embedding(weight, ids, op.padding_idx, op.scale, False)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        ctx.op.ids, = ctx.saved_tensors
        ctx.op.grad = dy
        return None, None, None


class _GraphOp(WeightOp):
    """Any other caught call: its own small autograd graph, asked for inputs in B and parameters in W."""

    __slots__ = ("out", "leaves")

    def __init__(self, params: list[Tensor], out: Tensor, leaves: list[Tensor]) -> None:
        super().__init__(params)
        self.out, self.leaves = out, leaves

    def weight_grads(self) -> list[Optional[Tensor]]:
        if self.grad is None:
            return []
        grads = list(torch.autograd.grad(self.out, self.leaves, self.grad, allow_unused=True))
        self.out = self.grad = None  # type: ignore[assignment]
        return grads


class _CutGraph(torch.autograd.Function):
    """One operation as one node over its own small graph: backward gives the input gradients [1]."""

    @staticmethod
    def forward(ctx: Any, func: Any, call: tuple[list, dict, list], ops: list,  # type: ignore[override]
                *tensors: Tensor) -> Tensor:
        args, kwargs, slots = call  # slots: where each tensor goes (an index of args, or a keyword)
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
            for slot, leaf in zip(slots, leaves):
                if isinstance(slot, int):
                    args[slot] = leaf
                else:
                    kwargs[slot] = leaf
            out = func(*args, **kwargs)
        params = [k for k, t in enumerate(tensors) if _is_parameter(t)]
        op = _GraphOp([tensors[k] for k in params], out, [leaves[k] for k in params])
        ops.append(op)
        ctx.op = op
        ctx.inputs = [(k, leaf) for k, (leaf, t) in enumerate(zip(leaves, tensors))
                      if t.requires_grad and k not in params]
        ctx.n = len(tensors)
        return out.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        op: _GraphOp = ctx.op
        op.grad = grad
        grads: list[Optional[Tensor]] = [None] * ctx.n
        if ctx.inputs:  # keep the small graph: W runs the weight half of the same kernels [2]
            got = torch.autograd.grad(op.out, [leaf for _, leaf in ctx.inputs], grad, retain_graph=True,
                                      allow_unused=True)
            for (k, _), g in zip(ctx.inputs, got):
                grads[k] = g
        return (None, None, None, *grads)


def _bind(args: tuple, kwargs: dict, names: tuple[str, ...], defaults: tuple) -> Optional[list]:
    """The arguments in ``names``' order (``defaults`` for the last ones), or None for a call this does not know."""
    if len(args) > len(names) or any(key not in names[len(args):] for key in kwargs):
        return None
    tail = names[len(args):]
    return [*args, *(kwargs.get(key, default) for key, default in zip(tail, defaults[len(defaults) - len(tail):]))]


def _plain(x: Any, dims: tuple[int, ...]) -> bool:
    """A contiguous tensor that is not a parameter, of one of these dimensions (0: any above 1)."""
    return (isinstance(x, Tensor) and not isinstance(x, nn.Parameter) and x.is_contiguous()
            and (x.dim() in dims or (0 in dims and x.dim() > 1)))


def _params(*tensors: Optional[Tensor]) -> Optional[list[Tensor]]:
    """The tensors given (None skipped) if each is a plain contiguous parameter with a gradient, else None."""
    got = [t for t in tensors if t is not None]
    return got if all(_is_parameter(t) and t.is_contiguous() for t in got) else None


def _linear(ops: list, args: tuple, kwargs: dict) -> Optional[Tensor]:
    bound = _bind(args, kwargs, ("input", "weight", "bias"), (None,))
    if bound is None:
        return None
    x, weight, bias = bound
    params = _params(weight, bias)
    if params is None or not _plain(x, (0,)) or weight.dim() != 2 or (bias is not None and bias.dim() != 1):
        return None
    op = _LinearOp(params, addmm=False)
    ops.append(op)
    return _CutLinear.apply(op, x, weight, bias)


def _addmm(ops: list, args: tuple, kwargs: dict) -> Optional[Tensor]:
    if len(args) != 3 or kwargs:  # beta, alpha or out: a small graph
        return None
    bias, x, weight = args
    params = _params(weight, bias)
    if params is None or bias is None or not _plain(x, (2,)) or weight.dim() != 2 or bias.dim() != 1:
        return None
    op = _LinearOp(params, addmm=True)
    ops.append(op)
    return _CutLinear.apply(op, x, weight, bias)


def _layer_norm(ops: list, args: tuple, kwargs: dict) -> Optional[Tensor]:
    bound = _bind(args, kwargs, ("input", "normalized_shape", "weight", "bias", "eps"), (None, None, 1e-5))
    if bound is None:
        return None
    x, shape, weight, bias, eps = bound
    if weight is None or bias is None or _params(weight, bias) is None or not _plain(x, (0, 1)):
        return None
    op = _NormOp([weight, bias], list(shape))
    ops.append(op)
    return _CutNorm.apply(op, x, weight, bias, eps)


def _embedding(ops: list, args: tuple, kwargs: dict) -> Optional[Tensor]:
    bound = _bind(args, kwargs, ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq",
                                 "sparse"), (None, None, 2.0, False, False))
    if bound is None:
        return None
    ids, weight, padding_idx, max_norm, _, scale, sparse = bound
    if max_norm is not None or sparse or _params(weight) is None or weight.dim() != 2 or not isinstance(ids, Tensor):
        return None
    if padding_idx is None:
        padding_idx = -1
    elif padding_idx < 0:  # as F.embedding normalises it
        padding_idx += weight.shape[0]
    op = _EmbeddingOp([weight], padding_idx, bool(scale))
    ops.append(op)
    return _CutEmbedding.apply(op, ids, weight)


_CUTS: dict[Any, Callable[[list, tuple, dict], Optional[Tensor]]] = {
    F.linear: _linear, torch.addmm: _addmm, F.layer_norm: _layer_norm, F.embedding: _embedding}


class record_weight_ops(TorchFunctionMode):
    """Catch the parameterised operations of a forward, so that its backward can be split.

    Example::

        with record_weight_ops() as recorder:
            loss = stage(x)
        dx = torch.autograd.grad(loss, [x] + params, allow_unused=True)  # B (no weight products)
        add_gradients(weight_gradients(recorder.ops))                    # W

    Attributes:
        ops: the :class:`WeightOp` of every caught call, in the order they ran.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[WeightOp] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        cut = _CUTS.get(func)  # every torch call of the forward passes here: the fewer steps the better
        if cut is None or not torch.is_grad_enabled():
            return func(*args, **kwargs) if kwargs else func(*args)
        kwargs = kwargs or {}
        # under autocast PyTorch's kernels save the cast operands, which only a small graph keeps
        out = None if torch._C._is_any_autocast_enabled() else cut(self.ops, args, kwargs)
        if out is not None:
            return out
        if _catchable(func, args, kwargs):
            slots: list = [k for k, a in enumerate(args) if isinstance(a, Tensor)]
            slots += [key for key, a in kwargs.items() if isinstance(a, Tensor)]
            tensors = [args[slot] if isinstance(slot, int) else kwargs[slot] for slot in slots]
            if any(_is_parameter(t) for t in tensors):
                return _CutGraph.apply(func, (list(args), dict(kwargs), slots), self.ops, *tensors)
        return func(*args, **kwargs)


def _catchable(func: Any, args: tuple, kwargs: dict) -> bool:
    """False for an embedding that renormalises its weight in place or has a sparse gradient."""
    if func is not F.embedding:
        return True
    max_norm = args[3] if len(args) > 3 else kwargs.get("max_norm")
    sparse = args[6] if len(args) > 6 else kwargs.get("sparse", False)
    return max_norm is None and not sparse


def weight_gradients(ops: list[WeightOp]) -> dict[Tensor, Tensor]:
    """W [2]: every recorded operation's parameter gradients, summed per parameter [3].

    Args:
        ops: the operations a forward recorded (:class:`record_weight_ops`) whose backward's B
            has run (operations no gradient reached are skipped).

    Returns:
        parameter -> its gradient from these operations. What the operations kept is freed.
    """
    summed: dict[Tensor, Tensor] = {}
    for op in ops:
        for p, g in zip(op.params, op.weight_grads()):
            if g is not None:
                summed[p] = summed[p] + g if p in summed else g
    return summed


def add_gradients(grads: dict[Tensor, Tensor]) -> None:
    """Add each gradient to its parameter's ``.grad`` (set it when None, in the parameter's layout)."""
    for p, g in grads.items():
        if p.grad is None:
            p.grad = g if g.stride() == p.stride() else torch.empty_like(p).copy_(g)
        else:
            p.grad.add_(g)
