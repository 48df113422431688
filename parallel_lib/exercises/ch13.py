"""Exercises for chapter 13: the block-table lookup (``ch13_block_table``, checked on a real engine run), the
admission rule (checked against the library's :class:`~parallel_lib.serving.scheduler.Scheduler` on several
situations) and speculative sampling's acceptance rule (checked against
:func:`~parallel_lib.serving.speculative.verify_token` with the same random numbers, then statistically: the
tokens it gives follow the target's distribution). The reference answers are in ``solutions.py``."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from parallel_lib.exercises._core import (CheckResult, Exercise, as_int, call_student, failed, is_stub, passed, require_callable,
                                          show, solution, stub_result)
from parallel_lib.exercises.ch13_block_table import SLOT_STUB, check_block_slot
from parallel_lib.inference.batch import Request, Result
from parallel_lib.serving.block_manager import BlockManager
from parallel_lib.serving.scheduler import Scheduler, Sequence
from parallel_lib.serving.speculative import draw, verify_token

__all__ = ["check_block_slot", "check_admit_requests", "check_accept_draft", "scheduler_admits", "EXERCISES"]

ADMIT_STUB = '''\
def admit_requests(free_blocks, waiting, running, max_batch, block_size):
    """Which waiting requests the scheduler admits into this step's batch.

    free_blocks: blocks free in the pool (after the running sequences took what they need this step);
    waiting: the waiting requests' lengths in tokens (prompt, plus tokens already generated if it was
    preempted), oldest first; running: sequences already in the batch; max_batch: sequences in one step at
    most; block_size: token slots per block. A request needs the blocks for all of its tokens at once.
    Return the positions in `waiting` of the requests admitted (a list of ints).
    """
    ...  # your code here
'''

ACCEPT_STUB = '''\
import torch


def accept_draft(p, q, token, u):
    """Speculative sampling's check of one guess.

    p, q: (V,) float64 tensors, the target's and the draft's probabilities at this position; token: the
    draft's guess (drawn from q, so q[token] > 0); u: a uniform random number in [0, 1).
    Return (True, None) if the guess is accepted; otherwise (False, r): r, a (V,) tensor, the distribution
    the replacement token is drawn from (non-negative entries summing to 1).
    """
    ...  # your code here
'''


# --------------------------------------------------------------------------- the admission rule

# (free_blocks, waiting lengths, running, max_batch, block_size): each situation exposes one mistake
_SITUATIONS = ((10, [5, 3, 9], 1, 4, 4), (3, [4, 4, 4, 4], 0, 8, 4), (20, [1, 1, 1, 1], 2, 4, 4),
               (3, [13, 2], 0, 4, 4), (1, [5], 0, 4, 4), (3, [12, 1], 0, 4, 4), (8, [2, 30, 3], 3, 4, 8),
               (5, [6, 6], 4, 4, 4), (4, [9, 4, 4], 1, 8, 4))


def scheduler_admits(free_blocks: int, waiting: list[int], running: int, max_batch: int,
                     block_size: int) -> list[int]:
    """What the library's :class:`Scheduler` admits in this situation (positions in ``waiting``).

    Builds a pool of ``running + free_blocks`` blocks and lets the scheduler admit ``running`` sequences of
    ``block_size - 1`` prompt tokens (a block each); each then gets its first token, as the engine gives it, so
    that it holds ``block_size`` tokens and needs no other block. Then ``waiting`` is queued and ``schedule``
    decides the next step.
    """
    scheduler = Scheduler(BlockManager(running + free_blocks, block_size), max_batch)
    sequences = [Sequence(i, Request([1] * max(block_size - 1, 1), 4), Result(i)) for i in range(running)]
    for seq in sequences:
        scheduler.add(seq)
    if sequences:
        plan = scheduler.schedule()
        assert plan.admitted == list(range(running)), "the running sequences must all be admitted first"
        for seq, stop in zip(plan.sequences, plan.stops):  # what the engine does after the forward pass
            seq.computed = stop
            seq.result.tokens.append(0)
    first = 1000
    for j, length in enumerate(waiting):
        scheduler.add(Sequence(first + j, Request([1] * length, 4), Result(first + j)))
    return [i - first for i in scheduler.schedule().admitted]


def _admit_variant(skip_head=False, count_running=True, ceil=True, subtract=True, strict=False, extra=0,
                   plus_one=False) -> Callable:
    def admit(free: int, waiting: list[int], running: int, max_batch: int, block_size: int) -> list[int]:
        room = max_batch - (running if count_running else 0) + extra
        out = []
        for i, length in enumerate(waiting):
            if len(out) >= room:
                break
            need = -(-length // block_size) if ceil else length // block_size
            need = length // block_size + 1 if plus_one else need
            if need < free if strict else need <= free:
                out.append(i)
                free -= need if subtract else 0
            elif not skip_head:
                break
        return out
    return admit


_ADMIT_WRONG = (
    (_admit_variant(skip_head=True), "admitted past a blocked head",
     "first come, first served: when the oldest waiting request does not fit, no younger one may overtake it"),
    (_admit_variant(count_running=False), "the running sequences not counted in max_batch",
     "max_batch bounds the whole batch: the sequences already running take their places first"),
    (_admit_variant(extra=1), "one sequence more than max_batch",
     "the batch may hold max_batch sequences, running and admitted together, not one more"),
    (_admit_variant(ceil=False), "blocks counted with floor division",
     "a request of 5 tokens in blocks of 4 needs 2 blocks: round the division up"),
    (_admit_variant(plus_one=True), "a block too many for a prompt that fills its blocks",
     "length // block_size + 1 is one too many when the length is a multiple of block_size: round up instead"),
    (_admit_variant(subtract=False), "free blocks never decrease",
     "each admitted request takes its blocks: the next one sees fewer free"),
    (_admit_variant(strict=True), "a request that fits exactly is refused",
     "a request needing exactly the free blocks fits (<=, not <)"),
)


def _as_positions(got: Any) -> list[int]:
    if isinstance(got, torch.Tensor):
        got = got.tolist()
    if not isinstance(got, (list, tuple)):
        raise TypeError(f"a list of positions in `waiting`, not a {type(got).__name__}")
    return [as_int(i) for i in got]


def check_admit_requests(fn: Any) -> CheckResult:
    """Each situation's admissions against the library's :class:`Scheduler` (:func:`scheduler_admits`)."""
    name = "admit_requests"
    require_callable(fn, name)
    if is_stub(fn):
        return stub_result(name, name)
    answers = []
    for situation in _SITUATIONS:
        free, waiting, running, max_batch, block_size = situation
        label = f"admit_requests({free}, {waiting}, {running}, {max_batch}, {block_size})"
        want = scheduler_admits(*situation)
        got, failure = call_student(name, label, fn, (free, list(waiting), running, max_batch, block_size),
                                    _as_positions, "the answer")
        if failure is not None:
            return failure
        answers.append(got)
        if got != want:  # the typical mistake that gives every answer so far, if one does
            named, hint = next(((n, h) for wrong, n, h in _ADMIT_WRONG
                                if all(wrong(*s) == a for s, a in zip(_SITUATIONS, answers))), ("", ""))
            return failed(name, label, f"the scheduler admits {want}, you admitted {got}"
                          + (f" ({named})" if named else ""), hint)
    return passed(name, f"{len(_SITUATIONS)} situations, each against the library's Scheduler.schedule()")


# --------------------------------------------------------------------------- the acceptance rule

_VOCAB, _CASES, _DRAWS = 5, 40, 3000


def _distributions(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(1.5 * torch.randn(_VOCAB, generator=g, dtype=torch.float64), 0)
    q = torch.softmax(1.5 * torch.randn(_VOCAB, generator=g, dtype=torch.float64), 0)
    return p, q


def _uniform(seed: int) -> tuple[float, torch.Generator]:
    """The first uniform of the stream ``seed`` (as :func:`verify_token` draws it) and the stream after it."""
    g = torch.Generator().manual_seed(seed)
    return float(torch.rand((), generator=g, dtype=torch.float64)), g


_ACCEPT_WRONG: tuple[tuple[Callable[[torch.Tensor, torch.Tensor, int, float], bool], str, str], ...] = (
    (lambda p, q, t, u: u < float(q[t] / p[t]), "accepted with probability q/p",
     "the ratio is upside down: a guess the target likes more than the draft did should be kept more often"),
    (lambda p, q, t, u: bool(p[t] >= q[t]), "u not used",
     "a guess the target finds less likely than the draft did is still kept sometimes: with probability p/q"),
    (lambda p, q, t, u: u < float(p[t]), "q not used",
     "the chance of keeping a guess compares the two models: p(x) / q(x), not p(x) alone"),
)
_RESIDUAL_WRONG: tuple[tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], str, str], ...] = (
    (lambda p, q: p, "resampled from p",
     "drawing a rejected guess's replacement from p counts the tokens the draft already proposes twice: draw "
     "from what p has beyond q"),
    (lambda p, q: (q - p).clamp_min(0) / (q - p).clamp_min(0).sum(), "max(0, q - p)",
     "the replacement comes from where the target gives more than the draft, not less"),
    (lambda p, q: (p - q).clamp_min(0), "not normalised", "a distribution sums to 1: divide by its sum"),
    (lambda p, q: (p - q) / (p - q).sum(), "p - q without max(0, ·)",
     "probabilities are never negative: keep only where p exceeds q"),
)


def _rounded(t: torch.Tensor, digits: int) -> str:
    return show([round(x, digits) for x in t.tolist()])


def _as_decision(got: Any) -> tuple[bool, Optional[torch.Tensor]]:
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        raise TypeError("(accepted, resample_from): a pair")
    accepted, r = got
    if isinstance(accepted, torch.Tensor):
        accepted = bool(accepted)
    if not isinstance(accepted, bool):
        raise TypeError(f"(accepted, resample_from) with accepted a bool, not a {type(accepted).__name__}")
    if not accepted:
        if not isinstance(r, torch.Tensor) or r.shape != (_VOCAB,):
            raise TypeError(f"(False, r) with r a tensor of shape ({_VOCAB},), got {show(r, 80)}")
        r = r.detach().to(torch.float64)
    return accepted, (None if accepted else r)


def _name(table: tuple, *args: Any, got: Any, same: Callable[[Any, Any], bool]) -> tuple[str, str]:
    for wrong, named, hint in table:
        try:
            if same(wrong(*args), got):
                return named, hint
        except Exception:  # noqa: BLE001 - a variant that cannot be computed here names nothing
            continue
    return "", ""


def check_accept_draft(fn: Any) -> CheckResult:
    """Decisions and replacement distributions against :func:`verify_token` on 40 cases, then 3,000 draws vs p."""
    name = "accept_draft"
    require_callable(fn, name)
    if is_stub(fn):
        return stub_result(name, name)
    decisions = []
    for seed in range(_CASES):
        p, q = _distributions(seed)
        token = draw(q, torch.Generator().manual_seed(1000 + seed))
        u, after = _uniform(seed)
        kept, replaced = verify_token(p, q, token, torch.Generator().manual_seed(seed))
        label = f"accept_draft(p={_rounded(p, 3)}, q={_rounded(q, 3)}, token={token}, u={u:.3f})"
        got, failure = call_student(name, label, fn, (p.clone(), q.clone(), token, u), _as_decision, "the answer")
        if failure is not None:
            return failure
        decisions.append((p, q, token, u, got[0]))
        if got[0] != replaced:
            named, hint = "", ""
            for wrong, n, h in _ACCEPT_WRONG:
                if all(wrong(*d[:4]) == d[4] for d in decisions):
                    named, hint = n, h
                    break
            want = "accepted" if replaced else "rejected"
            return failed(name, label, f"the rule keeps the guess with probability min(1, p/q) = "
                          f"{min(1.0, float(p[token] / q[token])):.3f}: {want}, you "
                          f"{'accepted' if got[0] else 'rejected'}" + (f" ({named})" if named else ""), hint)
        if not got[0]:
            r, residual = got[1], (p - q).clamp_min(0)
            want = residual / residual.sum()
            if not torch.allclose(r, want, rtol=1e-9, atol=1e-12):
                named, hint = _name(_RESIDUAL_WRONG, p, q, got=r, same=lambda a, b: torch.allclose(a, b, atol=1e-9))
                return failed(name, label, f"rejected: expected to resample from {_rounded(want, 4)}, got "
                              f"{_rounded(r, 4)}" + (f" ({named})" if named else ""), hint)
            if draw(r, after) != kept:  # the library's redraw from the same stream picks the same token
                return failed(name, label, f"the library redraws token {kept} from the same random stream")
    counts = torch.zeros(_VOCAB, dtype=torch.float64)
    g = torch.Generator().manual_seed(12345)
    p, q = _distributions(7)
    for _ in range(_DRAWS):
        token = draw(q, g)
        accepted, r = _as_decision(fn(p, q, token, float(torch.rand((), generator=g, dtype=torch.float64))))
        counts[token if accepted else draw(r, g)] += 1
    freq = counts / _DRAWS
    gap = float((freq - p).abs().max())
    if gap > 0.03:
        return failed(name, None, f"over {_DRAWS} guesses the tokens kept or redrawn have frequencies "
                      f"{_rounded(freq, 3)}, not the target's {_rounded(p, 3)}")
    return passed(name, f"{_CASES} cases against serving.speculative.verify_token (accepted and rejected, same "
                  f"random numbers); over {_DRAWS} guesses from q the tokens follow p to within {gap:.3f}")


EXERCISES = [
    Exercise("block_slot", check_block_slot, SLOT_STUB, solution("block_slot"),
             "Write the block-table lookup: the pool slot of a sequence's token. The checker compares with the "
             "library on small tables, then serves the walkthrough's requests until the pool is full and gathers "
             "every running sequence's keys from the engine's pool through your slots."),
    Exercise("admit_requests", check_admit_requests, ADMIT_STUB, solution("admit_requests"),
             "Write the admission rule: which waiting requests join the batch this step. The checker builds each "
             "situation for the library's scheduler and compares what it admits."),
    Exercise("accept_draft", check_accept_draft, ACCEPT_STUB, solution("accept_draft"),
             "Write speculative sampling's check of one guess: keep it, or say what to draw instead. The checker "
             "compares with the library's rule on the same random numbers, then checks that the tokens it gives "
             "follow the target's distribution."),
]
