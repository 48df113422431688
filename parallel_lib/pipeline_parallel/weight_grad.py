"""The split backward of zero-bubble schedules, cut at each parameterised operation.

A whole backward of a linear layer ``y = x Wᵀ + b`` runs two matrix products: ``dx = dy W``
(the *input* gradient, which the previous stage waits for) and ``dW = dyᵀ x`` (the *weight*
gradient, which nobody waits for until the optimizer step). Zero-bubble schedules (Qi et al.,
2023) run them as two actions: B computes only the input gradients through the stage and keeps,
for every parameterised operation, what its weight gradient needs (the operation's input and
its output gradient); W, later, computes only the weight gradients from them. B + W then costs
what one whole backward costs.

How the cut is made. While F runs, :class:`record_weight_ops` (a ``TorchFunctionMode``) catches
each call of a parameterised operation (``F.linear``, ``torch.addmm`` (GPT-2's ``Conv1D``),
``F.embedding``, ``F.layer_norm``) that takes a parameter, and runs it as one autograd node of
the stage's graph whose own backward is split::

    stage graph            one caught operation (its own small graph, built in F)
    ... <- [op node] <-    x_leaf, W_leaf -> y = linear(x_leaf, W_leaf, b_leaf)
             |
        B:   [1] keep dy; dx = grad(y, x_leaf, dy)          (autograd: only the dx product runs)
        W:   [2] dW, db = grad(y, (W_leaf, b_leaf), dy)    (only the dW product and the bias sum)
             [3] add them to W.grad, b.grad

[1] In B the node returns the input gradient and no gradient for its parameters; autograd
    prunes the weight product from ``grad(y, x_leaf)`` because ``W_leaf`` is not asked for.
    The small graph keeps what PyTorch's own kernel saved (``x`` and ``W``); everything else
    the stage saved is freed by B.
[2] W asks the same small graphs for the parameters only: every operation's weight product
    in one call, from the same saved tensors through the same kernels, so B then W gives the
    bits of one whole backward.
[3] Contributions of one parameter (a tied embedding used twice) are summed first, then added
    to ``.grad`` once, as autograd's ``AccumulateGrad`` does.

A parameter used by any other operation (``weight[ids]``, ``x @ W``) keeps autograd's ordinary
backward: B computes its gradient (:meth:`~parallel_lib.pipeline_parallel.stage.StageRunner.backward_input`
asks for it) and W adds it. Only plain ``nn.Parameter``\\ s are caught (a DTensor parameter
keeps the ordinary backward).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

__all__ = ["WEIGHT_OPS", "WeightOp", "record_weight_ops", "weight_gradients", "add_gradients"]

WEIGHT_OPS = (F.linear, torch.addmm, F.embedding, F.layer_norm)  # the operations whose W is cut out


def _is_parameter(t: Any) -> bool:
    return type(t) is nn.Parameter and t.requires_grad


class WeightOp:
    """One caught operation: its small graph, its parameters and (after B) its output gradient.

    Attributes:
        out: the operation's output in its own small graph.
        leaves: the parameters' stand-ins in that graph (detached aliases).
        params: the parameters themselves, in the same order.
        grad: the output gradient B received (None before B, or when no gradient reached it).
    """

    __slots__ = ("out", "leaves", "params", "grad")

    def __init__(self, out: Tensor, leaves: list[Tensor], params: list[Tensor]) -> None:
        self.out, self.leaves, self.params = out, leaves, params
        self.grad: Optional[Tensor] = None


class _SplitOp(torch.autograd.Function):
    """One parameterised operation as one node: backward gives the input gradient and keeps dy [1]."""

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
        op = WeightOp(out, [leaves[k] for k in params], [tensors[k] for k in params])
        ops.append(op)
        ctx.op = op
        ctx.inputs = [(k, leaf) for k, (leaf, t) in enumerate(zip(leaves, tensors))
                      if t.requires_grad and k not in params]
        ctx.n = len(tensors)
        ctx.product = _input_product(func, args, kwargs, slots, tensors, [k for k, _ in ctx.inputs])
        return out.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        op: WeightOp = ctx.op
        op.grad = grad
        grads: list[Optional[Tensor]] = [None] * ctx.n
        if ctx.product is not None:  # a linear layer's dx = dy W, the product autograd would run
            k, product = ctx.product
            grads[k] = product(grad)
        elif ctx.inputs:  # keep the small graph: W runs the weight half of the same kernels [2]
            got = torch.autograd.grad(op.out, [leaf for _, leaf in ctx.inputs], grad, retain_graph=True,
                                      allow_unused=True)
            for (k, _), g in zip(ctx.inputs, got):
                grads[k] = g
        return (None, None, None, *grads)


def _input_product(func: Any, args: list, kwargs: dict, slots: list, tensors: tuple, inputs: list) -> Any:
    """``(k, dy -> dx)`` for a linear layer whose only input with a gradient is its ``x`` (tensor k), else None.

    The product is the one autograd's backward of ``F.linear`` / ``torch.addmm`` runs for the input
    (so the gradients stay bitwise those of a whole backward), without a second autograd call per
    operation in B; any other case asks the small graph.
    """
    if func is F.linear and slots[:2] == [0, 1] and inputs == [0] and _is_parameter(tensors[1]):
        weight = tensors[1]
        return 0, lambda dy: dy.matmul(weight)
    if (func is torch.addmm and not kwargs and len(args) == 3 and slots == [0, 1, 2] and inputs == [1]
            and _is_parameter(tensors[2]) and tensors[1].dim() == 2):
        weight = tensors[2]
        return 1, lambda dy: dy.mm(weight.t())
    return None


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
        kwargs = kwargs or {}
        if func in WEIGHT_OPS and torch.is_grad_enabled() and _catchable(func, args, kwargs):
            slots: list = [k for k, a in enumerate(args) if isinstance(a, Tensor)]
            slots += [key for key, a in kwargs.items() if isinstance(a, Tensor)]
            tensors = [args[slot] if isinstance(slot, int) else kwargs[slot] for slot in slots]
            if any(_is_parameter(t) for t in tensors):
                return _SplitOp.apply(func, (list(args), dict(kwargs), slots), self.ops, *tensors)
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
        parameter -> its gradient from these operations. The small graphs are freed.
    """
    done = [op for op in ops if op.grad is not None and op.leaves]
    if not done:
        return {}
    grads = torch.autograd.grad([op.out for op in done], [leaf for op in done for leaf in op.leaves],
                                [op.grad for op in done], allow_unused=True)
    summed: dict[Tensor, Tensor] = {}
    it = iter(grads)
    for op in done:
        for p in op.params:
            g = next(it)
            if g is not None:
                summed[p] = summed[p] + g if p in summed else g
        op.out = op.grad = None  # type: ignore[assignment]
    return summed


def add_gradients(grads: dict[Tensor, Tensor]) -> None:
    """Add each gradient to its parameter's ``.grad`` (set it when None, in the parameter's layout)."""
    for p, g in grads.items():
        if p.grad is None:
            p.grad = g if g.stride() == p.stride() else torch.empty_like(p).copy_(g)
        else:
            p.grad.add_(g)
