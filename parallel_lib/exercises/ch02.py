"""Exercises for chapter 02: averaging gradients over real ranks, and the ring all-reduce's steps.

``check_average_gradients`` runs the student's function where it matters: in
``_WORLD`` real gloo ranks started by ``parallel_lib.runtime.launcher``, each holding the
gradients of its own batch (see ``_shipping`` for how a notebook function gets there).
Before paying for the spawn, it calls the function once in this process, in a
one-rank group, so that a crash is reported at once and with its own traceback line.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from parallel_lib.data_parallel.ring import ring_steps
from parallel_lib.exercises._core import (
    solution,
    Case,
    CheckResult,
    Exercise,
    as_int,
    as_number,
    check_function,
    close,
    failed,
    is_stub,
    passed,
    require_callable,
    same_number,
    show,
    stub_result,
)
from parallel_lib.exercises._shipping import ShippedFunction, ship
from parallel_lib.exercises.ch02_overlap import OVERLAP_STUB, check_bucketed_allreduce
from parallel_lib.runtime.launcher import LaunchTimeoutError, RankError, launch

__all__ = ["check_average_gradients", "check_ring_bytes_sent", "check_ring_send_chunk", "EXERCISES"]

AVERAGE_GRADIENTS_STUB = '''\
def average_gradients(model):
    """After loss.backward() on every rank: replace each parameter's .grad by its mean over all ranks.

    Use torch.distributed (import torch.distributed as dist): dist.all_reduce and dist.get_world_size().
    """
    ...  # your code here
'''

RING_BYTES_STUB = '''\
def ring_bytes_sent(nbytes, world_size):
    """Bytes each rank sends during a ring all-reduce of a tensor of `nbytes` bytes over `world_size` ranks."""
    ...  # your code here
'''

RING_CHUNK_STUB = '''\
def ring_send_chunk(rank, step, world_size):
    """Which chunk (0 .. world_size-1) `rank` sends to rank + 1 at `step` of a ring all-reduce.

    Steps 0 .. world_size-2 are the reduce-scatter, steps world_size-1 .. 2*world_size-3 the all-gather.
    At step 0 every rank sends its own chunk: rank r sends chunk r.
    """
    ...  # your code here
'''

_WORLD = 3                  # not 2, so that "divide by 2" cannot pass for "divide by the world size"
_LAUNCH_TIMEOUT_S = 60.0    # a few tiny all-reduces once the ranks have started (start-up has its own 60 s)
_CASES = ("two linear layers", "a frozen first layer")


def _replica(case: str, rank: int) -> nn.Module:
    """The same model on every rank, with gradients of rank ``rank``'s own batch."""
    with torch.random.fork_rng(devices=[]):  # leave the notebook's random state alone
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        if case == "a frozen first layer":
            model[0].requires_grad_(False)
        x = torch.randn(5, 3, generator=torch.Generator().manual_seed(100 + rank))  # (batch, features)
    model(x).pow(2).sum().backward()
    return model


def _grads(model: nn.Module) -> dict[str, Optional[torch.Tensor]]:
    return {name: None if p.grad is None else p.grad.detach().clone() for name, p in model.named_parameters()}


def _average_gradients_rank(rank: int, world_size: int, student: ShippedFunction) -> list[dict]:
    """Worker run by every rank: each case's gradients after the student's function."""
    fn = student.load()
    results = []
    for case in _CASES:
        model = _replica(case, rank)
        try:
            fn(model)
        except Exception as error:
            raise RuntimeError(f"case {case!r}: {type(error).__name__}: {error}") from error
        results.append(_grads(model))
    return results


def _single_rank_trial(fn: Any) -> Optional[tuple[str, str]]:
    """Run ``fn`` on each case in a one-rank group in this process: (case, crash) for the first crash."""
    if dist.is_initialized():  # the notebook has its own group: leave it alone, the ranks will tell
        return None
    try:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    except RuntimeError:  # gloo found no usable network interface here; the spawned ranks pin loopback
        return None
    try:
        for case in _CASES:
            try:
                fn(_replica(case, 0))
            except Exception as error:
                return repr(case), f"raised {type(error).__name__}: {error}"
    finally:
        dist.destroy_process_group()
    return None


_SAME_CALLS = ("every rank must make the same all_reduce calls, in the same order; "
               "a rank that skips one leaves the others waiting or failing")


def _crash_hint(message: str) -> str:
    if "None" in message:
        return "a parameter with requires_grad=False has no gradient (.grad is None): skip it"
    if "NameError" in message:
        return ("the ranks run only the source of average_gradients and the modules it uses; "
                "import inside the function or define helpers inside it")
    return ""


def _compare(results: list[list[dict]]) -> Optional[tuple[str, str, str]]:
    """(case, what is wrong, hint) for the first gradient that is not the mean over ranks, else None."""
    for c, case in enumerate(_CASES):
        local = [_grads(_replica(case, r)) for r in range(_WORLD)]
        for rank in range(_WORLD):
            for name, own in local[rank].items():
                got = results[rank][c][name]
                if own is None:  # a frozen parameter: no gradient, or a zero one, is fine
                    if got is not None and bool(got.any()):
                        return case, f"rank {rank}: '{name}' is frozen but got a gradient", "skip frozen parameters"
                    continue
                mean = torch.stack([local[r][name] for r in range(_WORLD)]).mean(0)
                if got is not None and torch.allclose(got, mean, rtol=1e-5, atol=1e-6):
                    continue
                where = f"rank {rank}, gradient of '{name}'"
                if got is None:
                    return case, f"{where} is None", "keep the gradients: average them in place"
                if torch.allclose(got, mean * _WORLD, rtol=1e-5, atol=1e-6):
                    return case, f"{where} is the sum over the {_WORLD} ranks", "divide by dist.get_world_size()"
                if torch.allclose(got, own):
                    return case, f"{where} is unchanged", "all_reduce each gradient (it works in place)"
                return (case, f"{where}: expected {show(mean.flatten().tolist())}, got {show(got.flatten().tolist())}",
                        "all_reduce(SUM) each gradient, then divide by the world size")
    return None


def check_average_gradients(fn: Any) -> CheckResult:
    """Check ``average_gradients(model)`` in a real ``_WORLD``-rank gloo job (a few seconds).

    Every rank builds the same small model, computes the gradients of its own batch and
    calls ``fn``; afterwards every rank's gradients must equal their mean over the ranks.
    """
    name = "average_gradients"
    require_callable(fn, name)
    if is_stub(fn):
        return stub_result(name, name)
    crash = _single_rank_trial(fn)
    if crash:
        return failed(name, crash[0], crash[1], _crash_hint(crash[1]))
    try:
        results = launch(_average_gradients_rank, _WORLD, ship(fn), backend="gloo", timeout=_LAUNCH_TIMEOUT_S,
                         threads_per_rank=1)
    except ValueError as error:  # the source could not be read
        return failed(name, None, str(error))
    except LaunchTimeoutError as error:
        if error.phase == "start-up":  # the machine is busy: not the student's mistake
            return failed(name, None, str(error).splitlines()[0], "run the check again when the machine is quieter")
        return failed(name, None, f"the {_WORLD} ranks did not finish within {_LAUNCH_TIMEOUT_S:g} s", _SAME_CALLS)
    except RankError as error:
        last = error.traceback_text.strip().splitlines()[-1] if error.traceback_text else str(error)
        match = re.fullmatch(r"RuntimeError: case ('.*?'): (.*)", last)  # raised by _average_gradients_rank
        case, crash = match.groups() if match else (None, last)
        # a rank that fails in a collective while others have returned: the others skipped it
        hint = _SAME_CALLS if error.returned else _crash_hint(crash)
        return failed(name, case, f"rank {error.ranks[0]} raised {crash}", hint)
    problem = _compare(results)
    if problem:
        case, what, hint = problem
        return failed(name, repr(case), what, hint)
    return passed(name, f"{len(_CASES)} cases on {_WORLD} gloo ranks")


def _bytes_per_rank(nbytes: int, world_size: int) -> float:
    """What rank 0 sends in the library's ring record, for float32 elements."""
    numel = nbytes // 4
    return float(sum(4 * (step.transfers[0].stop - step.transfers[0].start) for step in ring_steps(world_size, numel)))


def _bytes_hint(args: tuple, got: Any) -> str:
    nbytes, n = args
    guesses = {2 * nbytes: "2·S counts the whole tensor at every step; each step sends one chunk of S/N bytes",
               (n - 1) * nbytes: "(N-1)·S is sending the whole tensor to every other rank; the ring sends chunks",
               (n - 1) * nbytes / n: "that is the reduce-scatter only; the all-gather sends as much again"}
    for value, hint in guesses.items():
        if isinstance(got, float) and n > 1 and close(value, got):
            return hint
    return "2(N-1) steps, each sending one chunk of S/N bytes"


def check_ring_bytes_sent(fn: Any) -> CheckResult:
    """Check ``ring_bytes_sent(nbytes, world_size)`` against the library's ring step record."""
    shapes = [(4_000_000, 2), (4_000_000, 4), (1200, 3), (4096, 8), (1000, 1), (2**30, 16)]
    cases = [Case(shape, _bytes_per_rank(*shape)) for shape in shapes]
    return check_function("ring_bytes_sent", fn, "ring_bytes_sent", cases, normalise=as_number,
                          compare=same_number, hint=_bytes_hint)


def _chunk_hint(args: tuple, got: Any) -> str:
    rank, step, n = args
    if step >= n - 1:
        return (f"in the all-gather (steps {n - 1} .. {2 * n - 3}) rank r first sends the chunk it has just "
                "finished reducing, (r + 1) % N, then the one it received the step before")
    return "in the reduce-scatter rank r passes on the chunk it received (and added to) the step before"


def check_ring_send_chunk(fn: Any) -> CheckResult:
    """Check ``ring_send_chunk(rank, step, world_size)`` against ``parallel_lib.data_parallel.ring.ring_steps``."""
    cases = [Case((t.src, s, n), t.chunk) for n in (2, 3, 4, 5)
             for s, step in enumerate(ring_steps(n, n)) for t in step.transfers]
    return check_function("ring_send_chunk", fn, "ring_send_chunk", cases, normalise=as_int, hint=_chunk_hint)


EXERCISES = [
    Exercise("average_gradients", check_average_gradients, AVERAGE_GRADIENTS_STUB, solution("average_gradients"),
             "Write `average_gradients(model)` in this notebook and watch it run on 3 real gloo ranks: the "
             "checker ships your cell to them. It must survive a frozen layer (a parameter without `.grad`)."),
    Exercise("bucketed_allreduce", check_bucketed_allreduce, OVERLAP_STUB, solution("attach_bucketed_allreduce"),
             "Overlap communication with backward: write `attach_bucketed_allreduce(model, bucket_bytes)`, which "
             "hooks the parameters so that buckets of gradients are all-reduced while `loss.backward()` still "
             "runs. The checker runs it on 3 gloo ranks and notes when each all-reduce starts."),
    Exercise("ring_bytes_sent", check_ring_bytes_sent, RING_BYTES_STUB, solution("ring_bytes_sent"),
             "Write `ring_bytes_sent(nbytes, world_size)`: the bytes each rank sends in a ring all-reduce, from "
             "the two phases you watched above."),
    Exercise("ring_send_chunk", check_ring_send_chunk, RING_CHUNK_STUB, solution("ring_send_chunk"),
             "Write `ring_send_chunk(rank, step, world_size)`: which chunk a rank passes on at each step of the "
             "ring, through both phases."),
]
