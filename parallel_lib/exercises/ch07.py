"""Exercises for chapter 07: the row-parallel forward, a missing all-reduce found from gradients, and the bytes of TP."""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch

from parallel_lib.exercises._core import (
    Case,
    CheckResult,
    Exercise,
    as_number,
    check_function,
    check_value,
    failed,
    passed,
    require_callable,
    is_stub,
    same_number,
    stub_result,
)
from parallel_lib.tensor_parallel.cost import layer_collectives, wire_bytes

__all__ = ["check_row_parallel_forward", "check_missing_operator", "check_tp_block_bytes", "EXERCISES"]

ROW_FORWARD_STUB = '''\
def row_parallel_forward(x_mine, weight_mine, bias, all_reduce):
    """This rank's part of y = x @ weight.T + bias, with weight split by input features.

    x_mine: (batch, in/t), my slice of the input features; weight_mine: (out, in/t), my
    columns of the weight; bias: (out,), the whole bias, held by every rank.
    all_reduce(t) returns the sum of t over all ranks (every rank must call it).
    Return the whole y (batch, out), equal on every rank.
    """
    ...  # your code here
'''

MISSING_OPERATOR_STUB = '''\
# One of "f forward", "f backward", "g forward", "g backward": which operator's collective is missing?
MISSING_OPERATOR = ...
'''

BLOCK_BYTES_STUB = '''\
def tp_block_bytes(batch, seq, hidden, n_layer, tp, bytes_per_element=4):
    """Bytes ONE rank sends for the transformer blocks in one training step (forward and backward),
    tensor parallel without sequence parallelism, ring all-reduce (each rank sends 2(t-1)/t of a message).
    """
    ...  # your code here
'''


def _row_reference(x_mine: torch.Tensor, weight_mine: torch.Tensor, bias: torch.Tensor,
                   all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    return all_reduce(x_mine @ weight_mine.T) + bias


class _ThreadGroup:
    """``tp`` threads standing in for ranks: ``all_reduce`` sums what every thread passed (a barrier each)."""

    def __init__(self, tp: int) -> None:
        self.inbox: list[Optional[torch.Tensor]] = [None] * tp
        self.barrier = threading.Barrier(tp, timeout=3)
        self.calls = [0] * tp

    def all_reduce_for(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            self.calls[rank] += 1
            self.inbox[rank] = torch.as_tensor(t).detach().clone()
            self.barrier.wait()
            total = sum(self.inbox)  # type: ignore[arg-type]
            self.barrier.wait()  # nobody overwrites the inbox before all have summed
            return total
        return all_reduce


def _run_ranks(fn: Callable[..., Any], tp: int, seed: int) -> tuple[list[Any], torch.Tensor, dict]:
    """Every rank's answer for a random layer split ``tp`` ways, the dense answer, and what happened."""
    g = torch.Generator().manual_seed(seed)
    x, weight, bias = torch.randn(3, 4 * tp, generator=g), torch.randn(5, 4 * tp, generator=g), torch.randn(5, generator=g)
    group, answers, errors = _ThreadGroup(tp), [None] * tp, [None] * tp

    def rank_main(r: int) -> None:
        try:
            answers[r] = fn(x.chunk(tp, 1)[r], weight.chunk(tp, 1)[r], bias, group.all_reduce_for(r))
        except threading.BrokenBarrierError:
            errors[r] = "waited in all_reduce for ranks that never called it"
        except Exception as error:  # the student's bug
            errors[r] = f"raised {type(error).__name__}: {error}"
            group.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    return answers, x @ weight.T + bias, dict(errors=errors, calls=group.calls, bias=bias)


def check_row_parallel_forward(fn: Any) -> CheckResult:
    """Run ``row_parallel_forward`` on 2 and 4 thread-ranks; every rank must return the dense output."""
    name = "row_parallel_forward"
    require_callable(fn, name)
    if is_stub(fn):
        return stub_result(name, name)
    for tp, seed in ((2, 0), (4, 1), (2, 2)):
        label = f"{tp} ranks, seed {seed}"
        answers, expected, info = _run_ranks(fn, tp, seed)
        problems = [(r, e) for r, e in enumerate(info["errors"]) if e]
        if problems:
            return failed(name, label, f"rank {problems[0][0]} {problems[0][1]}",
                          "every rank calls all_reduce the same number of times")
        for r, got in enumerate(answers):
            if got is None:
                return failed(name, label, f"rank {r} returned None: return y")
            got = torch.as_tensor(got)
            if got.shape != expected.shape:
                return failed(name, label, f"rank {r} returned shape {tuple(got.shape)}, expected {tuple(expected.shape)}",
                              "the whole output (batch, out) on every rank: all-reduce the partial products")
            if not torch.allclose(got, expected, atol=1e-5):
                if torch.allclose(got, expected + (tp - 1) * info["bias"], atol=1e-5):
                    hint = f"the bias was summed {tp} times: add it once, after the all-reduce"
                elif info["calls"][r] == 0:
                    hint = "each rank holds only a partial product: sum them with all_reduce"
                else:
                    hint = "y = all_reduce(x_mine @ weight_mine.T) + bias"
                return failed(name, label, f"rank {r}'s output differs from the dense layer's by up to "
                              f"{float((got - expected).abs().max()):.3g}", hint)
    return passed(name, "3 cases on 2 and 4 thread-ranks")


_MISSING_HINTS = {
    "f forward": "f's forward is the identity: nothing is communicated there, so nothing can be missing",
    "g forward": "without g's forward all-reduce the outputs themselves would be partial sums, but they match",
    "g backward": "g's backward is the identity: nothing is communicated there",
}


def check_missing_operator(answer: Any) -> CheckResult:
    """The broken layer's outputs and weight gradients match, its input gradient does not: f's backward all-reduce."""
    def normalise(value: Any) -> str:
        if not isinstance(value, str):
            raise TypeError(f"one of the strings {['f forward', 'f backward', 'g forward', 'g backward']}")
        return " ".join(value.lower().split())

    return check_value("missing_operator", answer, "MISSING_OPERATOR", "f backward", normalise=normalise,
                       hint=lambda got: _MISSING_HINTS.get(got, "look at which gradient is wrong, and which "
                                                           "operator produces it in the backward pass"))


def _block_bytes(batch: int, seq: int, hidden: int, n_layer: int, tp: int, bytes_per_element: int = 4) -> float:
    per_layer = layer_collectives(batch, seq, hidden, False, bytes_per_element)
    return n_layer * sum(wire_bytes(per_layer[phase], tp) for phase in ("forward", "backward"))


def _bytes_hint(args: tuple, got: Any) -> str:
    expected = _block_bytes(*args)
    if got and abs(got * 2 - expected) < 1e-6 * expected:
        return "half of it: the backward pass has its two all-reduces (the two f) too"
    b, s, h, n_layer, tp = args[:5]
    if got and abs(got - 4 * n_layer * b * s * h * 4) < 1e-6 * expected:
        return f"that is the message size; a ring sends 2(t-1)/t of it per rank ({2 * (tp - 1) / tp:g}x)"
    return "per block: 2 all-reduces forward + 2 backward, each of batch·seq·hidden elements"


def check_tp_block_bytes(fn: Any) -> CheckResult:
    """Check ``tp_block_bytes`` against :func:`parallel_lib.tensor_parallel.cost.layer_collectives`."""
    shapes = [(1, 1, 1, 1, 2), (4, 32, 64, 4, 2), (8, 1024, 768, 12, 4), (8, 1024, 768, 12, 8), (2, 128, 256, 6, 1)]
    cases = [Case(shape, _block_bytes(*shape)) for shape in shapes]
    return check_function("tp_block_bytes", fn, "tp_block_bytes", cases, normalise=as_number, compare=same_number,
                          hint=_bytes_hint)


EXERCISES = [
    Exercise("row_parallel_forward", check_row_parallel_forward, ROW_FORWARD_STUB, _row_reference),
    Exercise("missing_operator", check_missing_operator, MISSING_OPERATOR_STUB, "f backward"),
    Exercise("tp_block_bytes", check_tp_block_bytes, BLOCK_BYTES_STUB, _block_bytes),
]
