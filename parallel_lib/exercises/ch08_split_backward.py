"""Chapter 08's W exercise: the weight gradient of one linear layer, as a split backward's W computes it.

The student writes ``linear_weight_grad(x, grad_y)``: for ``y = x @ weight.T + bias``, the gradients
of ``weight`` and ``bias`` from the layer's saved input and its output gradient. The checker
compares with autograd on inputs of two and three dimensions (a batch of sequences), then puts
the function into every linear layer of a model (a custom autograd function, which the split
backward keeps whole: its B runs it and W adds what it returned), trains it on a ZB-H1 ``Pipe``
and compares every gradient with the unsplit ``nn.Linear`` model's. The library's own W for a
linear layer runs the same product (:mod:`parallel_lib.pipeline_parallel.weight_grad`).
Recognised mistakes: the product transposed, the bias's gradient not summed over the rows,
a 3-D input summed over its first dimension only, a mean where the gradient is a sum.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from parallel_lib.exercises._core import CheckResult, failed, is_stub, passed, require_callable, show, stub_result
from parallel_lib.pipeline_parallel.pipe import Pipe

__all__ = ["LINEAR_WEIGHT_GRAD_STUB", "check_linear_weight_grad"]

_NAME = "linear_weight_grad"
LINEAR_WEIGHT_GRAD_STUB = '''\
def linear_weight_grad(x, grad_y):
    """W of a split backward for y = x @ weight.T + bias: return (grad_weight, grad_bias).

    x: the layer's input saved by F, shape (..., in_features) (e.g. batch, sequence, features);
    grad_y: the gradient of the loss w.r.t. y, shape (..., out_features), received by B.
    grad_weight has the weight's shape (out_features, in_features); grad_bias is (out_features,).
    """
    ...  # your code here
'''

_SHAPES = [((5, 3), 4), ((2, 6, 3), 4), ((1, 3), 2)]  # (x's shape, out_features): never square, a 3-D batch


def _case(shape: tuple[int, ...], out: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(x, grad_y, autograd's weight gradient, autograd's bias gradient) of one seeded case."""
    generator = torch.Generator().manual_seed(sum(shape) + out)
    x = torch.randn(*shape, generator=generator)
    layer = nn.Linear(shape[-1], out)
    grad_y = torch.randn(*shape[:-1], out, generator=generator)
    layer(x).backward(grad_y)
    return x, grad_y, layer.weight.grad, layer.bias.grad  # type: ignore[return-value]


def _hint(x: Tensor, grad_y: Tensor, which: str, got: Any, expected: Tensor) -> str:
    if not isinstance(got, Tensor):
        return ""
    if which == "grad_weight" and got.shape == expected.T.shape:
        return "the weight maps in_features to out_features: its gradient has the weight's shape (out, in)"
    if which == "grad_bias" and got.dim() > 1 and got.shape[-1] == expected.shape[0]:
        return "the bias is added to every row: its gradient sums grad_y over every row, not only one dimension"
    if which == "grad_weight" and x.dim() > 2 and got.dim() > 2:
        return "a batch of sequences has rows along every dimension but the last: flatten them first"
    if got.shape == expected.shape and torch.allclose(got * grad_y[..., 0].numel(), expected, atol=1e-5):
        return "a mean over the rows: the loss's own averaging is already inside grad_y, so sum"
    return "each row adds (its output gradient) times (its input) to the weight's gradient"


def _compare(x: Tensor, grad_y: Tensor, got: Any, expected: tuple[Tensor, Tensor]) -> Optional[tuple[str, str]]:
    """(problem, hint) if ``got`` is not (grad_weight, grad_bias) equal to autograd's, else None."""
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return f"returned {show(got, 100)}, but the answer must be a pair (grad_weight, grad_bias)", ""
    for which, value, want in zip(("grad_weight", "grad_bias"), got, expected):
        if not isinstance(value, Tensor):
            return f"{which} is a {type(value).__name__}, not a tensor", ""
        if value.shape != want.shape:
            return (f"{which} has shape {tuple(value.shape)}, autograd's has {tuple(want.shape)}",
                    _hint(x, grad_y, which, value, want))
        if not torch.allclose(value, want, rtol=1e-5, atol=1e-6):
            worst = (value - want).abs().max().item()
            return f"{which} differs from autograd's by up to {worst:.3g}", _hint(x, grad_y, which, value, want)
    return None


class _StudentLinear(torch.autograd.Function):
    """y = x @ weight.T + bias, whose weight gradients come from the student's function."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor, fn: Callable) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.fn = fn
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_y: Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        grad_weight, grad_bias = ctx.fn(x, grad_y)  # one node: a split backward's B runs it whole
        return grad_y @ weight, grad_weight, grad_bias, None


class _Layer(nn.Linear):
    def __init__(self, fn: Callable, width: int) -> None:
        super().__init__(width, width)
        self.fn = fn

    def forward(self, x: Tensor) -> Tensor:
        return _StudentLinear.apply(x, self.weight, self.bias, self.fn)


def _model(fn: Optional[Callable], width: int = 8, layers: int = 4) -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    if fn is None:
        return model
    student = nn.Sequential(*[_Layer(fn, width) for _ in range(layers)])
    student.load_state_dict(model.state_dict())
    return student


def _pipe_problem(fn: Callable) -> Optional[str]:
    """Train the student's layers on a ZB-H1 Pipe; what differs from the unsplit model, or None."""
    x, y = torch.randn(8, 8, generator=torch.Generator().manual_seed(2)), torch.zeros(8, 8)
    reference = _model(None)
    nn.functional.mse_loss(reference(x), y).backward()
    model = _model(fn)
    with Pipe(model, ["cpu", "cpu"], chunks=4, schedule="zb-h1", timeout=30.0) as pipe:
        pipe.train_step(x, y, nn.functional.mse_loss)
    for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
        if param.grad is None or not torch.allclose(param.grad, expected.grad, rtol=1e-5, atol=1e-6):
            return (f"on the ZB-H1 Pipe (2 ranks, 4 micro-batches) the gradient of layer {name} "
                    f"{'is missing' if param.grad is None else 'differs from the unsplit model'}")
    return None


def check_linear_weight_grad(fn: Any) -> CheckResult:
    """Check ``linear_weight_grad(x, grad_y)`` against autograd, then inside every W of a ZB-H1 ``Pipe``."""
    require_callable(fn, _NAME)
    if is_stub(fn):
        return stub_result(_NAME, _NAME)
    for shape, out in _SHAPES:
        x, grad_y, grad_weight, grad_bias = _case(shape, out)
        label = f"{_NAME}(x of shape {shape}, grad_y of shape {tuple(grad_y.shape)})"
        try:
            got = fn(x.clone(), grad_y.clone())
        except Exception as error:  # the student's bug, reported with its case
            return failed(_NAME, label, f"raised {type(error).__name__}: {error}")
        if got is None:
            return failed(_NAME, label, "returned None: the function is not written yet, or it forgets to `return`")
        problem = _compare(x, grad_y, got, (grad_weight, grad_bias))
        if problem is not None:
            return failed(_NAME, label, *problem)
    try:
        difference = _pipe_problem(fn)
    except Exception as error:  # a StageError wrapping the student's exception
        return failed(_NAME, "the ZB-H1 Pipe", f"raised {type(error).__name__}: {error}")
    if difference is not None:
        return failed(_NAME, "the ZB-H1 Pipe", difference)
    return passed(_NAME, f"{len(_SHAPES)} cases against autograd and every W of a ZB-H1 Pipe")
