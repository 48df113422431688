"""Exercises for chapter 07: the row-parallel forward on thread-ranks, then ``f`` and ``g`` as autograd functions
(``ch07_operators``) and the vocabulary-parallel cross-entropy (``ch07_vocab_loss``), both on gloo ranks.

Every checker compares with one process (the dense layer, the dense MLP, ``F.cross_entropy`` on the
gathered logits); the reference answers are in ``solutions.py``.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch

from parallel_lib.exercises._core import (
    CheckResult,
    Exercise,
    failed,
    passed,
    require_callable,
    is_stub,
    solution,
    stub_result,
)
from parallel_lib.exercises.ch07_operators import OPERATORS_STUB, check_tp_operators
from parallel_lib.exercises.ch07_vocab_loss import VOCAB_LOSS_STUB, check_vocab_cross_entropy

__all__ = ["check_row_parallel_forward", "check_tp_operators", "check_vocab_cross_entropy", "EXERCISES"]

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
                    hint = ("the dense y is x @ weight.T + bias: which part of it does each rank hold, and which part "
                            "is whole on every rank already?")
                return failed(name, label, f"rank {r}'s output differs from the dense layer's by up to "
                              f"{float((got - expected).abs().max()):.3g}", hint)
    return passed(name, "3 cases on 2 and 4 thread-ranks")


EXERCISES = [
    Exercise("row_parallel_forward", check_row_parallel_forward, ROW_FORWARD_STUB, solution("row_parallel_forward"),
             "Write the row-parallel forward. Each rank holds a slice of the input features and the matching "
             "columns of the weight; the checker runs your function on 2 and 4 thread-ranks."),
    Exercise("tp_operators", check_tp_operators, OPERATORS_STUB, solution("tp_operators"),
             "Write Megatron's `f` and `g` yourself, as autograd functions with `torch.distributed` (not the "
             "library's `regions`). The checker runs each one alone on 2 gloo ranks, then a column→row MLP with "
             "`f` before and `g` after, and compares the output, the input gradient and every weight gradient "
             "with the dense MLP."),
    Exercise("vocab_cross_entropy", check_vocab_cross_entropy, VOCAB_LOSS_STUB, solution("vocab_cross_entropy"),
             "Write the vocabulary-parallel cross-entropy of section 4 from the maximum, the sum of exponentials "
             "and the target's logit. The checker runs it on 2 gloo ranks against `F.cross_entropy` on the "
             "gathered logits, with targets -100 and with bfloat16 and float16 logits large enough to overflow "
             "`exp`."),
]
