"""Exercises for chapter 02: averaging gradients over real ranks, and the ring all-reduce's steps.

``check_average_token_gradients`` runs the student's function in ``_WORLD`` real gloo ranks,
each holding the gradient of the *mean* loss over its own, unequal number of tokens (``_shipping``
says how a notebook function gets there). Chapter 01 prints the article's plain mean over ranks;
this asks for the step it leaves out, weighing each rank by its tokens. Before paying for the
spawn, the checker calls the function once in a one-rank group here, so that a crash is
reported at once and with its own traceback line.
"""

from __future__ import annotations

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
from parallel_lib.exercises._ranks import run_on_ranks
from parallel_lib.exercises._shipping import ShippedFunction
from parallel_lib.exercises.ch02_overlap import OVERLAP_STUB, check_bucketed_allreduce

__all__ = ["check_average_token_gradients", "check_ring_bytes_sent", "check_ring_send_chunk", "EXERCISES"]

AVERAGE_TOKENS_STUB = '''\
def average_token_gradients(model, n_tokens):
    """After loss.backward() on every rank, where rank r's loss was the MEAN over its own `n_tokens`
    target tokens (an int; the ranks hold different numbers): leave in every .grad the gradient of
    the mean over ALL ranks' tokens, the same on every rank. Skip parameters without a gradient.

    Use torch.distributed (import torch.distributed as dist).
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
_TOKENS = (2, 5, 3)         # tokens (rows) of each rank's batch: unequal, so the plain mean over ranks is wrong
_LAUNCH_TIMEOUT_S = 60.0    # a few tiny all-reduces once the ranks have started (start-up has its own 60 s)
_CASES = ("two linear layers", "a frozen first layer")


def _batch(rank: int) -> torch.Tensor:
    """Rank ``rank``'s batch: ``_TOKENS[rank]`` rows, one token each."""
    return torch.randn(_TOKENS[rank], 3, generator=torch.Generator().manual_seed(100 + rank))


def _model(case: str) -> nn.Module:
    with torch.random.fork_rng(devices=[]):  # leave the notebook's random state alone
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    if case == "a frozen first layer":
        model[0].requires_grad_(False)
    return model


def _replica(case: str, rank: int) -> nn.Module:
    """The same model on every rank, holding the gradient of the mean loss over its own tokens."""
    model = _model(case)
    model(_batch(rank)).pow(2).sum(1).mean().backward()
    return model


def _global_reference(case: str) -> nn.Module:
    """One process on every rank's tokens at once: the gradient of the mean over all of them."""
    model = _model(case)
    model(torch.cat([_batch(r) for r in range(_WORLD)])).pow(2).sum(1).mean().backward()
    return model


def _grads(model: nn.Module) -> dict[str, Optional[torch.Tensor]]:
    return {name: None if p.grad is None else p.grad.detach().clone() for name, p in model.named_parameters()}


def _average_tokens_rank(rank: int, world_size: int, student: ShippedFunction) -> list[dict]:
    """Worker run by every rank: each case's gradients after the student's function."""
    fn = student.load()
    results = []
    for case in _CASES:
        model = _replica(case, rank)
        try:
            fn(model, _TOKENS[rank])
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
                fn(_replica(case, 0), _TOKENS[0])
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
        return ("the ranks run only the source of average_token_gradients and the modules it uses; "
                "import inside the function or define helpers inside it")
    return ""


def _wrong_answer(got: torch.Tensor, expected: torch.Tensor, local: list[torch.Tensor], rank: int) -> tuple[str, str]:
    """What a wrong gradient is (recognising the typical mistakes) and a hint."""
    def same(a: torch.Tensor) -> bool:
        return torch.allclose(got, a, rtol=1e-5, atol=1e-6)

    total, n = sum(_TOKENS), _TOKENS[rank]
    weighted = sum(t * g for t, g in zip(_TOKENS, local))
    if same(torch.stack(local).mean(0)):
        return ("is the plain mean over the ranks (the article's average_gradients)",
                f"that mean weighs a token of a rank with {min(_TOKENS)} tokens like "
                f"{max(_TOKENS) / min(_TOKENS):g} tokens of one with {max(_TOKENS)}: weigh each rank's gradient by "
                "its token count before summing")
    if same(torch.stack(local).sum(0)):
        return "is the plain sum over the ranks", "weigh each rank's gradient by its tokens, then divide by all tokens"
    if same(weighted):
        return "is the token-weighted sum", f"divide by the tokens of all ranks ({total}), which needs an all_reduce"
    if same(weighted / (n * _WORLD)) or same(weighted / n):
        return ("was divided by this rank's own token count",
                "every rank must divide by the same number, the tokens of all ranks: all_reduce the count too")
    if same(weighted / _WORLD):
        return "was divided by the world size", f"divide by the tokens of all ranks ({total}), not by the ranks"
    if same(local[rank]):
        return "is unchanged", "all_reduce each gradient (it works in place)"
    return (f"expected {show(expected.flatten().tolist())}, got {show(got.flatten().tolist())}",
            "the mean over all tokens is (sum over ranks of tokens_r * gradient_r) / (sum of tokens_r)")


def _compare(results: list[list[dict]]) -> Optional[tuple[str, str, str]]:
    """(case, what is wrong, hint) for the first gradient that is not the global token mean, else None."""
    for c, case in enumerate(_CASES):
        local = [_grads(_replica(case, r)) for r in range(_WORLD)]
        reference = _grads(_global_reference(case))
        for rank in range(_WORLD):
            for name, own in local[rank].items():
                got = results[rank][c][name]
                if own is None:  # a frozen parameter: no gradient, or a zero one, is fine
                    if got is not None and bool(got.any()):
                        return case, f"rank {rank}: '{name}' is frozen but got a gradient", "skip frozen parameters"
                    continue
                expected = reference[name]
                assert expected is not None
                if got is not None and torch.allclose(got, expected, rtol=1e-5, atol=1e-6):
                    continue
                where = f"rank {rank}, gradient of '{name}'"
                if got is None:
                    return case, f"{where} is None", "keep the gradients: change them in place"
                what, hint = _wrong_answer(got, expected, [g[name] for g in local], rank)  # type: ignore[misc]
                return case, f"{where} {what}", hint
    return None


def check_average_token_gradients(fn: Any) -> CheckResult:
    """Check ``average_token_gradients(model, n_tokens)`` in a real ``_WORLD``-rank gloo job (a few seconds).

    Every rank builds the same small model, computes the gradient of the mean loss over its
    own ``_TOKENS[rank]`` tokens and calls ``fn``; afterwards every rank's gradients must equal
    those of one process on all the ranks' tokens at once.
    """
    name = "average_token_gradients"
    require_callable(fn, name)
    if is_stub(fn):
        return stub_result(name, name)
    crash = _single_rank_trial(fn)
    if crash:
        return failed(name, crash[0], crash[1], _crash_hint(crash[1]))
    results = run_on_ranks(name, fn, _average_tokens_rank, _WORLD, timeout=_LAUNCH_TIMEOUT_S, crash_hint=_crash_hint,
                           same_calls=_SAME_CALLS)
    if isinstance(results, CheckResult):
        return results
    problem = _compare(results)
    if problem:
        case, what, hint = problem
        return failed(name, repr(case), what, hint)
    return passed(name, f"{len(_CASES)} cases on {_WORLD} gloo ranks holding {', '.join(map(str, _TOKENS))} tokens")


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
    Exercise("average_token_gradients", check_average_token_gradients, AVERAGE_TOKENS_STUB,
             solution("average_token_gradients"),
             "Chapter 01's `average_gradients` takes the plain mean of the ranks' gradients. When rank r's loss is "
             "the mean over its own n_r tokens, that is not the gradient one process would compute on all the "
             "tokens. Write `average_token_gradients(model, n_tokens)`, which is; the checker ships your cell to 3 "
             "gloo ranks holding 2, 5 and 3 tokens, one case with a frozen layer."),
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
