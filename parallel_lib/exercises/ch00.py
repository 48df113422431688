"""Exercises for chapter 00: which part of a tensor a rank owns, and what all_reduce returns
(predicted first, then measured on 4 real gloo ranks)."""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.distributed as dist

from parallel_lib.data_parallel.ring import ring_chunks
from parallel_lib.exercises._core import (
    solution,
    Case,
    CheckResult,
    Exercise,
    as_int,
    as_number,
    check_function,
    check_value,
    passed,
    show,
)
from parallel_lib.runtime.launcher import launch

__all__ = ["check_rank_slice", "check_all_reduce_prediction", "EXERCISES"]

RANK_SLICE_STUB = '''\
def rank_slice(numel, rank, world_size):
    """(start, stop) of the part of a flat tensor of `numel` elements that `rank` owns.

    The tensor is cut into `world_size` contiguous parts whose sizes differ by at most one;
    the first parts take the extra elements (like torch.tensor_split). A part may be empty.
    """
    ...  # your code here
'''

ALL_REDUCE_STUB = '''\
# 4 ranks. Rank r starts with    tensor = torch.tensor([r + 1.0, 10.0 * r])
# and every rank then calls      dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
# What does rank 3's tensor hold afterwards? Answer with a list of two numbers.
all_reduce_prediction = None  # your answer
'''


def _slice_cases() -> list[Case]:
    shapes = [(8, 2), (10, 3), (7, 4), (5, 1), (2, 3), (0, 2)]  # even, uneven, one rank, fewer elements than ranks
    return [Case((numel, rank, world_size), ring_chunks(world_size, numel)[rank])
            for numel, world_size in shapes for rank in range(world_size)]


def _as_bounds(value: Any) -> tuple[int, int]:
    if isinstance(value, range) and value.step == 1:
        return value.start, value.stop
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError("a pair (start, stop)")
    return as_int(value[0]), as_int(value[1])


def _slice_hint(args: tuple, got: Any) -> str:
    numel, rank, world_size = args
    if isinstance(got, tuple) and got == (rank * (numel // world_size), (rank + 1) * (numel // world_size)):
        return (f"with parts of numel // world_size = {numel // world_size} the last {numel % world_size} "
                "element(s) belong to nobody: give the first numel % world_size ranks one element more")
    return "part r starts after the sizes of parts 0 .. r-1; sizes are numel // world_size, plus one for r < numel % world_size"


def check_rank_slice(fn: Any) -> CheckResult:
    """Check ``rank_slice(numel, rank, world_size)`` against ``parallel_lib.data_parallel.ring.ring_chunks``."""
    return check_function("rank_slice", fn, "rank_slice", _slice_cases(), normalise=_as_bounds, hint=_slice_hint)


_START = [torch.tensor([r + 1.0, 10.0 * r]) for r in range(4)]  # what rank r holds before the all-reduce


def _as_pair(value: Any) -> list[float]:
    values = value.tolist() if isinstance(value, torch.Tensor) else value
    if not isinstance(values, (list, tuple)) or len(values) != 2:
        raise TypeError("a list of two numbers, one per element of the tensor")
    return [as_number(v) for v in values]


def _close(expected: list[float], got: list[float]) -> Optional[str]:
    if torch.allclose(torch.tensor(got), torch.tensor(expected)):
        return None
    return f"expected {show(expected)}, got {show(got)}"


def _all_reduce_hint(got: list[float]) -> str:
    tensors = torch.stack(_START)  # (ranks, 2)
    guesses = {
        "that is rank 3's tensor before the all-reduce; afterwards every rank holds the combined result":
            _START[3],
        "that is the mean; ReduceOp.SUM adds the tensors and does not divide by world_size":
            tensors.mean(0),
    }
    for hint, guess in guesses.items():
        if torch.allclose(guess, torch.tensor(got)):
            return hint
    return "the all-reduce is element-wise: add up the four starting tensors position by position"


def _all_reduce_rank(rank: int, world_size: int) -> list[float]:
    tensor = _START[rank].clone()
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.tolist()


@functools.lru_cache(maxsize=1)
def measured_all_reduce() -> tuple[list[float], str]:
    """Rank 3's tensor after a real 4-rank gloo ``all_reduce(SUM)``, and where it came from.

    Measured once per kernel (a few seconds); if ranks cannot start here, the element-wise sum is
    used instead and the message says so.
    """
    try:
        return launch(_all_reduce_rank, 4, backend="gloo", timeout=60, threads_per_rank=1)[3], "4 gloo ranks"
    except Exception:  # noqa: BLE001 - a machine that cannot start ranks still gets its prediction checked
        return torch.stack(_START).sum(0).tolist(), "the element-wise sum (ranks could not start here)"


def check_all_reduce_prediction(answer: Any) -> CheckResult:
    """Check the predicted result of a 4-rank ``all_reduce(SUM)`` against one measured on real ranks.

    The prediction is written down first (the stub cell); the check then runs the all-reduce.
    """
    if answer is None or answer is Ellipsis:  # not answered: do not spend a launch on it
        return check_value("all_reduce_prediction", answer, "all_reduce_prediction", None)
    expected, source = measured_all_reduce()
    result = check_value("all_reduce_prediction", answer, "all_reduce_prediction", expected,
                         normalise=_as_pair, compare=_close, hint=_all_reduce_hint)
    if result.passed:
        return passed("all_reduce_prediction", f"1 case: your prediction is what {source} computed, {show(expected)}")
    return result


EXERCISES = [
    Exercise("rank_slice", check_rank_slice, RANK_SLICE_STUB, solution("rank_slice"),
             "Write `rank_slice(numel, rank, world_size)`: the `(start, stop)` of the part of a flat tensor that "
             "`rank` owns, parts as equal as possible and none lost."),
    Exercise("all_reduce_prediction", check_all_reduce_prediction, ALL_REDUCE_STUB, solution("ALL_REDUCE_PREDICTION"),
             "Predict before you run: what does rank 3 hold after a 4-rank `all_reduce(SUM)`? Write your answer "
             "down first; the check then runs the all-reduce on 4 real gloo ranks and compares."),
]
