"""Exercises for chapter 01: cutting a data set into rank partitions, and the per-rank batch."""

from __future__ import annotations

from collections import Counter
from fractions import Fraction
from typing import Any, Optional

import torch

from parallel_lib.data.partition import DataPartitioner, partition_dataset
from parallel_lib.exercises._core import (
    solution,
    Case,
    CheckResult,
    Exercise,
    as_int,
    check_function,
    check_value,
    failed,
    is_stub,
    passed,
    require_callable,
    show,
    stub_result,
)

__all__ = ["check_wrong_dp_loop", "check_partition_indices", "check_local_batch_size", "check_steps_per_epoch",
           "EXERCISES"]

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

    Every rank gets the same number of examples: a few are repeated to fill up the last ranks,
    or, with drop_last=True, the extra ones are left out. Each step, every rank loads its share
    of the global batch; the last step of an epoch may be smaller. Section 1 shows the rule.
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


WRONG_LOOP_STUB = '''\
# Which loop, A, B or C, does NOT train like one process on the global batch, and why?
# Reasons: 1 = it averages after optimizer.step(), so each replica steps with its own gradient
#          2 = it sums the gradients without dividing, so its steps are world_size times too large
#          3 = dividing the loss by world_size shrinks the gradients below the mean
wrong_dp_loop = None  # your answer: (letter, reason), e.g. ("A", 2)
'''

# The three loops of the exercise, each run on 2 emulated ranks (an all-reduce is a sum over the
# copies), so the checker's answer is measured, not typed: the loop whose parameters leave one
# process's is the wrong one.
_LOOPS = {
    "A": "loss.backward(); average_gradients(model); optimizer.step()",
    "B": "loss.backward(); optimizer.step(); average_gradients(model)",
    "C": "(loss / world_size).backward(); all_reduce(grad, SUM) for each grad; optimizer.step()",
}
_REASONS = {1: "averages after the step", 2: "sums without dividing", 3: "the loss scaled by 1/world_size"}


def _train(loop: str, steps: int = 2, world_size: int = 2) -> torch.Tensor:
    """The weight after ``steps`` SGD steps of ``loop`` on ``world_size`` emulated ranks (rank 0's copy)."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    models = [torch.nn.Linear(3, 1) for _ in range(world_size)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]

    def all_reduce(scale: float) -> None:
        for params in zip(*(m.parameters() for m in models)):
            total = sum(p.grad for p in params) * scale
            for p in params:
                p.grad = total.clone()

    for _ in range(steps):
        for r, (m, opt) in enumerate(zip(models, optimizers)):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x[r::world_size]), y[r::world_size])
            (loss / world_size if loop == "C" else loss).backward()
        if loop == "B":
            for opt in optimizers:
                opt.step()
            all_reduce(1 / world_size)
        else:
            all_reduce(1.0 if loop == "C" else 1 / world_size)
            for opt in optimizers:
                opt.step()
    return models[0].weight.detach()


def _one_process(steps: int = 2) -> torch.Tensor:
    torch.manual_seed(0)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model.weight.detach()


def _wrong_loops() -> list[str]:
    reference = _one_process()
    return [name for name in _LOOPS if not torch.allclose(_train(name), reference, atol=1e-6)]


def _as_loop_answer(value: Any) -> tuple[str, int]:
    if not isinstance(value, (tuple, list)) or len(value) != 2 or not isinstance(value[0], str):
        raise TypeError('a pair (letter, reason), e.g. ("A", 2)')
    return value[0].strip().upper(), as_int(value[1])


def check_wrong_dp_loop(answer: Any) -> CheckResult:
    """Check the spotted loop against running all three on emulated ranks, and the reason against it."""
    wrong = _wrong_loops()
    assert wrong == ["B"], wrong  # the library's own sanity: exactly one loop leaves one process's parameters
    expected = ("B", 1)

    def hint(got: tuple[str, int]) -> str:
        letter, _ = got
        if letter == "C":
            return ("C divides the loss by world_size and then sums world_size gradients: that is the mean. "
                    "Run it: its parameters equal one process's")
        if letter == "A":
            return "A is chapter 01's loop: average, then step"
        if letter == "B":
            return f"B is the one; reason {got[1]} ({_REASONS.get(got[1], '?')}) is not what goes wrong"
        return "the letter is A, B or C"

    def compare(want: tuple[str, int], got: tuple[str, int]) -> Optional[str]:  # never reveal the answer
        if got == want:
            return None
        return f"{got} is not right: {'the reason' if got[0] == want[0] else 'the loop'} is wrong"

    return check_value("wrong_dp_loop", answer, "wrong_dp_loop", expected, normalise=_as_loop_answer,
                       compare=compare, hint=hint)


# local_batch_size stays importable (its checker) but is no exercise: section 1 prints its rule.
EXERCISES = [
    Exercise("partition_indices", check_partition_indices, PARTITION_STUB, solution("partition_indices"),
             "Write `partition_indices(n, world_size, seed)`: shuffle the example indices with `seed` and cut "
             "them into `world_size` partitions that lose no example (the article's `int(size * len)` drops "
             "one of 10 over 3 ranks)."),
    Exercise("steps_per_epoch", check_steps_per_epoch, STEPS_STUB, solution("steps_per_epoch"),
             "Write `steps_per_epoch(n, world_size, global_batch_size, drop_last)`: the optimizer steps of one "
             "epoch when the ranks share `n` examples as `partition_dataset` does."),
    Exercise("wrong_dp_loop", check_wrong_dp_loop, WRONG_LOOP_STUB, solution("WRONG_DP_LOOP"),
             "Spot the wrong loop. Each rank runs one of these on its own part of the global batch:\n\n"
             + "\n".join(f"- **{k}**: `{v}`" for k, v in _LOOPS.items())
             + "\n\nTwo of them leave every rank with the parameters of one process trained on the whole batch; "
             "one does not. Which, and why? The checker runs all three before it compares."),
]
