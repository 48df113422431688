"""Chapter 07's exercise on the vocabulary-parallel cross-entropy, run on gloo ranks.

The student computes each token's loss from this rank's slice of the logits and a few
all-reduces (the maximum, the sum of exponentials, the target's logit), never gathering the
logits. The checker ships the function to ``_WORLD`` gloo ranks and runs every case in one
launch; each rank records its ``dist.all_reduce`` calls (the reduction and whether the tensor
was this rank's row maxima), so that "the maximum summed instead of maxed" can be named. The
answers are compared with ``F.cross_entropy(gathered logits, target, ignore_index=-100,
reduction="none")`` in float64, case by case, in an order that isolates each mistake:

1. float32 logits of ordinary size: the three all-reduces and where the target is;
2. the same with targets -100: ignored tokens;
3. float32, bfloat16 and float16 logits large enough that ``exp`` overflows without the
   shift by the maximum (the library casts to float32 first; a student may not, so the
   tolerance follows the dtype's precision).

Where a case fails, the wrong answers students typically write are computed here in float64
and matched, so the message names the mistake; the hints say what to think about, not the code.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel_lib.exercises._core import CheckResult, failed, is_stub, passed, require_callable, stub_result
from parallel_lib.exercises._ranks import case_error, run_on_ranks
from parallel_lib.exercises._shipping import ShippedFunction

__all__ = ["VOCAB_LOSS_STUB", "check_vocab_cross_entropy"]

VOCAB_LOSS_STUB = '''\
import torch
import torch.distributed as dist


def vocab_cross_entropy(logits_mine, target, vocab_start):
    """Each token's cross-entropy when every rank holds only a slice of the vocabulary's logits.

    logits_mine: (tokens, V/t), this rank's logits, for the token ids vocab_start .. vocab_start + V/t - 1,
    in float32, bfloat16 or float16. target: (tokens,) ids over the whole vocabulary, the same on every
    rank; -100 marks a token that does not count (loss 0, as F.cross_entropy's ignore_index).
    Return the (tokens,) losses, the same on every rank, equal to F.cross_entropy(all the logits, target,
    reduction="none"), without gathering the logits: all-reduce a few numbers per token only.
    Use torch.distributed on the default group (the checker ships this source to 2 gloo ranks).
    """
    ...  # your code here
'''

_WORLD, _VOCAB, _TOKENS = 2, 16, 6
_SAME_MAX = 3  # tokens of the ordinary float32 cases whose slices share their maximum
IGNORE = -100
# (label, dtype, offset of the logits, targets set to -100, tolerance on a loss)
_CASES = (("float32 logits", torch.float32, 0.0, 0, 1e-5),
          ("float32 logits, 2 targets -100", torch.float32, 0.0, 2, 1e-5),
          ("float32 logits near 1000", torch.float32, 1000.0, 0, 1e-3),
          ("bfloat16 logits near 100", torch.bfloat16, 100.0, 1, 0.6),   # bf16 spacing is 0.5 at 100
          ("float16 logits near 30", torch.float16, 30.0, 1, 0.05))


def _inputs(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Case ``index``'s whole logits (tokens, V) in its dtype and its targets, the same in every process."""
    _, dtype, offset, ignored, _ = _CASES[index]
    g = torch.Generator().manual_seed(20 + index)
    logits = (torch.randn(_TOKENS, _VOCAB, generator=g, dtype=torch.float64) * 2 + offset).to(dtype)
    target = torch.randint(0, _VOCAB, (_TOKENS,), generator=g)
    target[0], target[1] = 1, _VOCAB - 2  # one target in each rank's slice at least
    if dtype == torch.float32 and not offset:  # the first tokens: every slice has the same maximum, where
        n = _VOCAB // _WORLD                   # shifting by a rank's own maximum happens to be right
        for token in range(_SAME_MAX):
            for s in range(1, _WORLD):
                logits[token, s * n + int(logits[token, s * n:(s + 1) * n].argmax())] = logits[token, :n].max()
    if ignored:
        target[-ignored:] = IGNORE
    return logits, target


_OPS = ("SUM", "MAX", "MIN", "AVG", "PRODUCT")


def _op_name(op: Any) -> str:
    return next((name for name in _OPS if hasattr(dist.ReduceOp, name) and op == getattr(dist.ReduceOp, name)), str(op))


def _vocab_loss_rank(rank: int, world_size: int, student: ShippedFunction) -> list[dict[str, Any]]:
    """Worker: every case on this rank, with its all-reduce calls recorded; the student's loss per case."""
    fn = student.load()
    original = dist.all_reduce
    results = []
    for index, (label, *_rest) in enumerate(_CASES):
        logits, target = _inputs(index)
        mine = logits.chunk(world_size, -1)[rank].clone()
        local_max = mine.double().max(-1).values
        calls: list[tuple[str, bool]] = []

        def recording(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, *args: Any, **kwargs: Any) -> Any:
            row_max = tensor.numel() == _TOKENS and torch.equal(tensor.detach().reshape(-1).double(), local_max)
            calls.append((_op_name(op), row_max))
            return original(tensor, op, *args, **kwargs)

        dist.all_reduce = recording  # the student's dist.all_reduce(...) looks the attribute up at call time
        try:
            loss = fn(mine, target.clone(), rank * (_VOCAB // world_size))
            loss = torch.as_tensor(loss).detach().to(torch.float64)
        except Exception as error:
            raise case_error(label, error) from error
        finally:
            dist.all_reduce = original
        results.append({"loss": loss, "calls": calls})
    return results


# ----------------------------------------------------------------------------- the reference and the wrong answers

def _reference(index: int) -> torch.Tensor:
    logits, target = _inputs(index)
    return F.cross_entropy(logits.double(), target, ignore_index=IGNORE, reduction="none")


def _wrong_answers(index: int, rank: int) -> list[tuple[torch.Tensor, str, str]]:
    """Rank ``rank``'s losses under each typical mistake (float64), with the mistake's name and a hint."""
    logits, target = _inputs(index)
    z, n = logits.double(), _VOCAB // _WORLD
    slices = z.split(n, -1)
    safe = target.clamp_min(0)
    zt = z.gather(-1, safe[:, None])[:, 0]
    top, lse = z.max(-1).values, torch.logsumexp(z, -1)
    picked_everywhere = sum(s.gather(-1, (target - r * n).clamp(0, n - 1)[:, None])[:, 0] for r, s in enumerate(slices))
    holds = (target >= rank * n) & (target < (rank + 1) * n)
    # each mistake written with the logits as given or shifted by the maximum (the two differ by multiples of it)
    return [
        (lse - top - zt, "the shift by the maximum is not undone", "log Σ exp(z - c) is the log-sum-exp of z minus c"),
        *[(value, "every rank contributed a target logit",
           "only one rank holds a token's target column; the other ranks' slices do not contain it, so they must "
           "add nothing") for value in (lse - picked_everywhere, lse - picked_everywhere + (_WORLD - 1) * top)],
        *[(value, "the target's logit was not shared between the ranks",
           "only the rank holding the target knows its logit, yet every rank must return the same loss")
          for value in (lse - zt * holds, lse - top - (zt - top) * holds)],
        ((slices[rank] - top[:, None]).exp().sum(-1).log() + top - zt, "the sum of exponentials covers this rank's "
         "slice only", "the softmax's denominator runs over the whole vocabulary, every rank's slice of it"),
    ]


def _diagnose(index: int, rank: int, got: torch.Tensor, results: list[list[dict]]) -> tuple[str, str]:
    """(what is wrong, hint) for rank ``rank``'s wrong losses in case ``index``."""
    label, dtype, offset, ignored, tol = _CASES[index]
    expected = _reference(index)
    calls = [call for per_rank in results for call in per_rank[index]["calls"]]
    if got.shape != expected.shape:
        hint = ("one loss per token, as reduction='none' gives: the mean comes later, over the counted tokens"
                if got.numel() == 1 else f"return a ({_TOKENS},) tensor, one loss per token")
        return f"rank {rank} returned shape {tuple(got.shape)}, expected {tuple(expected.shape)}", hint
    if any(op == "SUM" and row_max for op, row_max in calls):
        return ("the ranks' maxima were all-reduced with SUM",
                "the shift must be at least every logit of the token, on every rank: which reduction of the "
                "ranks' own maxima gives the largest logit of the whole row?")
    if not bool(torch.isfinite(got).all()) and not any(op == "MAX" and row_max for op, row_max in calls):
        return (f"rank {rank}'s losses are {got.tolist()}: exp overflowed, the logits were not shifted by their "
                "maximum",
                f"exp of a logit near {offset:g} is beyond {str(dtype).replace('torch.', '')}'s range (float32's ends "
                "at exp(88)); the softmax does not change when every logit of a token moves by the same amount")
    counted = _inputs(index)[1] != IGNORE
    if ignored and torch.allclose(got[counted], expected[counted], atol=tol, rtol=tol):
        return ("tokens with target -100 got a loss",
                "a token whose target is -100 must count zero, whatever its logits (F.cross_entropy's ignore_index)")
    for value, what, hint in _wrong_answers(index, rank):
        if torch.allclose(got[counted], value[counted], atol=tol, rtol=tol):
            return what, hint
    wrong = ~torch.isclose(got, expected, atol=tol, rtol=tol)
    maxima = [s.max(-1).values for s in _inputs(index)[0].double().split(_VOCAB // _WORLD, -1)]
    same_max = torch.stack([m == maxima[0] for m in maxima]).all(0)
    if (not any(op == "MAX" and row_max for op, row_max in calls) and bool(wrong.any())
            and not bool((wrong & same_max).any())):  # right exactly where the ranks' maxima agree
        return ("each rank shifted by its own maximum",
                "a token's logits must be shifted by the same amount on every rank, or the ranks' sums of "
                "exponentials do not add up")
    worst = int((got - expected).abs().argmax())
    return (f"rank {rank}, token {worst}: expected {float(expected[worst]):.6g}, got {float(got[worst]):.6g}",
            "a token's loss is log Σ exp(logits over the whole vocabulary) minus its target's logit")


def check_vocab_cross_entropy(fn: Any) -> CheckResult:
    """Check ``vocab_cross_entropy`` on 2 gloo ranks against ``F.cross_entropy`` on the gathered logits (5 cases)."""
    name = "vocab_cross_entropy"
    require_callable(fn, name)
    if is_stub(fn):
        return stub_result(name, name)
    results = run_on_ranks(name, fn, _vocab_loss_rank, _WORLD, crash_hint=_crash_hint)
    if isinstance(results, CheckResult):
        return results
    for index, (label, _dtype, _offset, _ignored, tol) in enumerate(_CASES):
        expected = _reference(index)
        for rank in range(_WORLD):
            got = results[rank][index]["loss"]
            if got.shape == expected.shape and torch.allclose(got, expected, atol=tol, rtol=tol):
                continue
            what, hint = _diagnose(index, rank, got, results)
            return failed(name, repr(label), what, hint)
    return passed(name, f"{len(_CASES)} cases on {_WORLD} gloo ranks (float32, targets -100, bfloat16 and float16 "
                  "logits beyond exp's range)")


def _crash_hint(message: str) -> str:
    if "index" in message.lower() and ("out of" in message or "bounds" in message):
        return ("logits_mine holds the columns of ids vocab_start .. vocab_start + V/t - 1 only: another rank's "
                "target, or -100, is not a column of it")
    if "NameError" in message:
        return "the ranks run only the source of vocab_cross_entropy and the modules it uses: define helpers inside it"
    return ""

