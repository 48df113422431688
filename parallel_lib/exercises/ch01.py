"""Exercises for chapter 01: cutting a data set into rank partitions, and the per-rank batch."""

from __future__ import annotations

from collections import Counter
from fractions import Fraction
from typing import Any, Optional

import torch

from parallel_lib.data.partition import DataPartitioner, partition_dataset
from parallel_lib.exercises import solutions
from parallel_lib.exercises._core import (
    Case,
    CheckResult,
    Exercise,
    as_int,
    check_function,
    failed,
    is_stub,
    passed,
    require_callable,
    show,
    stub_result,
)

__all__ = ["check_partition_indices", "check_local_batch_size", "check_steps_per_epoch", "EXERCISES"]

PARTITION_STUB = '''\
def partition_indices(n, world_size, seed):
    """Shuffle the example indices 0 .. n-1 with `seed` and cut them into `world_size` partitions.

    Every example must land in exactly one partition, partition sizes may differ by at most
    one, and the result must depend only on the arguments (every rank computes it on its own).
    Returns a list of `world_size` lists of indices.
    """
    ...  # your code here
'''

LOCAL_BATCH_STUB = '''\
def local_batch_size(global_batch_size, world_size):
    """How many examples each of `world_size` ranks loads per step for a global batch.

    Raise ValueError when the global batch cannot be split evenly over the ranks.
    """
    ...  # your code here
'''

STEPS_STUB = '''\
def steps_per_epoch(n, world_size, global_batch_size, drop_last=False):
    """Optimizer steps per epoch when `world_size` ranks share `n` examples (as partition_dataset does).

    Every rank gets the same number of examples: ceil(n / world_size), repeating a few examples
    to fill up, or floor(n / world_size) with drop_last=True. Each step a rank loads
    global_batch_size // world_size of them; the last step of an epoch may be smaller.
    """
    ...  # your code here
'''

_PARTITION_CASES = [(10, 2, 1234), (10, 3, 1234), (7, 4, 0), (1, 1, 0), (101, 4, 5), (40, 3, 7)]


def _as_partitions(value: Any) -> list[list[int]]:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise TypeError("a list with one list of indices per rank")
    parts = [part.tolist() if isinstance(part, torch.Tensor) else part for part in value]
    if not all(isinstance(part, (list, tuple, range)) for part in parts):
        raise TypeError("a list with one list of indices per rank")
    return [[as_int(i) for i in part] for part in parts]


def _partition_problem(parts: list[list[int]], n: int, world_size: int) -> Optional[tuple[str, str]]:
    """(what is wrong, hint) for partitions of range(n), or None when they are a fair split."""
    if len(parts) != world_size:
        return f"returned {len(parts)} partitions for world_size={world_size}", "one partition per rank"
    counts = Counter(i for part in parts for i in part)
    missing = [i for i in range(n) if i not in counts]
    if missing:
        return (f"examples {show(missing, 80)} are in no partition",
                "int(n / world_size) examples per rank drops the remainder: give the first n % world_size "
                "ranks one example more, or cut the shuffled list at rounded positions")
    if any(c > 1 for c in counts.values()) or set(counts) - set(range(n)):
        bad = sorted(i for i, c in counts.items() if c > 1 or not 0 <= i < n)
        return f"examples {show(bad, 80)} are repeated or not in 0..{n - 1}", "each example goes to exactly one rank"
    sizes = [len(part) for part in parts]
    if max(sizes) - min(sizes) > 1:
        return f"partition sizes {sizes} differ by more than one", "share the examples as evenly as possible"
    return None


def check_partition_indices(fn: Any) -> CheckResult:
    """Check ``partition_indices(n, world_size, seed)``: a shuffled, complete, even and seeded split.

    Any shuffle passes; on failure the message shows ``DataPartitioner``'s split as an example.
    """
    name = "partition_indices"
    require_callable(fn, name)
    if is_stub(fn):
        return stub_result(name, name)
    for n, world_size, seed in _PARTITION_CASES:
        label = f"{name}({n}, {world_size}, {seed})"
        try:
            value = fn(n, world_size, seed)
            again, other_seed = fn(n, world_size, seed), fn(n, world_size, seed + 1)
        except Exception as error:
            return failed(name, label, f"raised {type(error).__name__}: {error}")
        if value is None:
            return failed(name, label, "returned None: the function is not written yet, or it forgets to `return`")
        try:
            parts, again, other_seed = _as_partitions(value), _as_partitions(again), _as_partitions(other_seed)
        except TypeError as error:
            return failed(name, label, f"returned {show(value, 120)}, but the answer must be {error}")
        problem = _partition_problem(parts, n, world_size)
        if problem:
            reference = DataPartitioner(range(n), [Fraction(1, world_size)] * world_size, seed).partitions
            return failed(name, label, f"{problem[0]}; a correct split is {show(reference, 120)}", problem[1])
        if again != parts:
            return failed(name, label, "two calls with the same seed gave different partitions",
                          "every rank must compute the same split on its own: shuffle with a generator "
                          "seeded by `seed` (torch.Generator().manual_seed(seed) or random.Random(seed))")
        if n >= 10 and other_seed == parts:
            return failed(name, label, f"seed={seed + 1} gives the same partitions as seed={seed}: "
                          "the examples are not shuffled with the seed",
                          "shuffle with `seed` first, then cut (a new seed per epoch reshuffles; data in "
                          "file order would give each rank a biased part)")
    return passed(name, f"{len(_PARTITION_CASES)} cases")


def _library_or_error(call: Any) -> Any:
    """The library's answer, or the ValueError class if the library refuses the input."""
    try:
        return call()
    except ValueError:
        return ValueError


def _local_batch(global_batch_size: int, world_size: int) -> Any:
    data = list(range(world_size))
    return _library_or_error(lambda: partition_dataset(0, world_size, data, batch_size=global_batch_size).batch_size)


def _batch_hint(args: tuple, got: Any) -> str:
    global_batch_size, world_size = args
    if isinstance(got, int) and global_batch_size % world_size:
        return (f"{global_batch_size} examples cannot be split evenly over {world_size} ranks: raise ValueError "
                "instead of silently training on a different global batch")
    return ""


def check_local_batch_size(fn: Any) -> CheckResult:
    """Check ``local_batch_size(global_batch_size, world_size)`` against ``partition_dataset``'s rule."""
    shapes = [(32, 2), (128, 4), (6, 3), (5, 1), (10, 4), (3, 4), (7, 2)]
    cases = [Case(shape, _local_batch(*shape)) for shape in shapes]
    return check_function("local_batch_size", fn, "local_batch_size", cases, normalise=as_int, hint=_batch_hint)


def _steps(n: int, world_size: int, global_batch_size: int, drop_last: bool) -> int:
    loader = partition_dataset(0, world_size, list(range(n)), batch_size=global_batch_size, drop_last=drop_last)
    return len(loader)


def _steps_hint(args: tuple, got: Any) -> str:
    n, world_size, global_batch_size, drop_last = args
    if isinstance(got, int) and got == n // global_batch_size:
        return ("n // global_batch_size forgets that each rank's share is rounded up (padded) to "
                "ceil(n / world_size), or down with drop_last, and that a short last step still counts")
    return "per rank: ceil(n / world_size) examples (floor with drop_last), then ceil(examples / local batch) steps"


def check_steps_per_epoch(fn: Any) -> CheckResult:
    """Check ``steps_per_epoch(n, world_size, global_batch_size, drop_last)`` against ``len(partition_dataset(...))``."""
    shapes = [(100, 2, 10, False), (10, 3, 6, False), (11, 2, 4, False), (11, 2, 4, True), (9, 4, 8, False),
              (9, 4, 8, True), (5, 1, 5, False)]
    cases = [Case(shape, _steps(*shape)) for shape in shapes]
    return check_function("steps_per_epoch", fn, "steps_per_epoch", cases, normalise=as_int, hint=_steps_hint)


EXERCISES = [
    Exercise("partition_indices", check_partition_indices, PARTITION_STUB, solutions.partition_indices),
    Exercise("local_batch_size", check_local_batch_size, LOCAL_BATCH_STUB, solutions.local_batch_size),
    Exercise("steps_per_epoch", check_steps_per_epoch, STEPS_STUB, solutions.steps_per_epoch),
]
