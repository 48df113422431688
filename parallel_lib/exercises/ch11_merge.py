"""Chapter 11's exercise on the log-sum-exp merge of two partial attentions, run as one ring step on 2 gloo ranks.

Ring attention is exact because attention over the keys of two blocks can be rebuilt from
attention over each block alone: each partial result keeps, beside its output (the softmax-weighted
mean of the block's values), the log of its softmax's denominator, ``lse``. The student writes
that merge. The checker ships it to 2 gloo ranks, which run one step of the ring: each rank holds
its half of the queries and of the keys (the contiguous split), attends to its own block
(:func:`parallel_lib.context_parallel.tiled.tiled_forward`), swaps key/value blocks with the other
rank in one ``batch_isend_irecv``, attends to the block that came, and merges the two with the
student's function. Each rank's merged output and ``lse`` are compared, in the notebook's
process, with attention of its queries over *all* keys computed in float64, case by case:

1. no mask, ordinary scores: the weights (plain average, weighting by the ``lse`` themselves,
   forgetting to divide by the total) and the returned ``lse``;
2. a causal mask: rank 0's queries may see nothing of rank 1's block (``lse = -inf`` there);
3. scores near 150: ``exp(lse)`` overflows float32 unless it is shifted by the larger ``lse``.

Where a case fails, the typical wrong answers are computed here from the same partials and
matched, so the message names the mistake; the hints say what to think about, not the code.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from parallel_lib.context_parallel.layout import shard_positions
from parallel_lib.context_parallel.tiled import tiled_forward
from parallel_lib.exercises._core import CheckResult, failed, is_stub, passed, require_callable, stub_result
from parallel_lib.exercises._ranks import case_error, run_on_ranks
from parallel_lib.exercises._shipping import ShippedFunction
from parallel_lib.runtime.waiting import wait_for

__all__ = ["MERGE_STUB", "check_merge_attention"]

MERGE_STUB = '''\
import torch


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Attention over the keys of two blocks, from attention over each block alone.

    out_a: (batch, heads, queries, head_dim), for each query the softmax-weighted mean of block a's values;
    lse_a: (batch, heads, queries), the log of that softmax's denominator, log Σ_j exp(score_j) over block a's
    keys (-inf for a query that may see no key of block a; its out_a is then 0). The same for block b.
    Return (out, lse): attention of the same queries over the keys of both blocks, and its log-denominator,
    in float32, for scores large enough that exp of them overflows. (The checker runs it on 2 gloo ranks:
    each attends to its own block, receives the other rank's, and merges the two.)
    """
    ...  # your code here
'''

_WORLD = 2
# (label, causal, factor on the queries: scores grow with it)
_CASES = (("no mask", False, 1.0),
          ("causal: rank 0's queries see nothing of rank 1's block", True, 1.0),
          ("scores near 150: exp overflows float32", False, 60.0))
_SHAPE = (1, 2, 8, 8)  # batch, heads, whole sequence, head_dim
_TOL = {"out": 1e-5, "lse": 1e-4}


def _inputs(index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Case ``index``'s whole q, k, v (the same in every process)."""
    gen = torch.Generator().manual_seed(110 + index)
    q, k, v = (torch.randn(_SHAPE, generator=gen) for _ in range(3))
    return q * _CASES[index][2], k, v


def _merge_rank(rank: int, world_size: int, student: ShippedFunction, timeout: float = 30.0) -> list[dict]:
    """Worker: one ring step per case on this rank; the partials and the student's merge of them."""
    fn = student.load()
    peer = (rank + 1) % world_size
    found = []
    for index, (label, causal, _) in enumerate(_CASES):
        q, k, v = _inputs(index)
        s = q.shape[2]
        mine = shard_positions(s, world_size, rank)
        theirs = shard_positions(s, world_size, peer)
        kv = torch.stack([k[:, :, mine], v[:, :, mine]]).contiguous()
        out_a, lse_a = tiled_forward(q[:, :, mine], kv[0], kv[1], causal, mine, mine, block=4)
        inbox = torch.empty_like(kv)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, peer), dist.P2POp(dist.irecv, inbox, peer)])
        for work in works:
            wait_for(work, timeout, f"rank {rank}: the key/value block from rank {peer}")
        out_b, lse_b = tiled_forward(q[:, :, mine], inbox[0], inbox[1], causal, mine, theirs, block=4)
        try:
            got = fn(out_a.clone(), lse_a.clone(), out_b.clone(), lse_b.clone())
        except Exception as error:
            raise case_error(label, error) from error
        found.append({"partials": (out_a, lse_a, out_b, lse_b), "answer": _plain(got)})
    return found


def _plain(got: Any) -> Any:
    """The answer as detached tensors where it is a pair of them (anything else travels as its repr)."""
    if isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got):
        return tuple(t.detach().cpu() for t in got)
    return repr(got)[:200]


def _reference(index: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of rank ``rank``'s queries over every key, and its log-denominator, in float64."""
    q, k, v = (t.double() for t in _inputs(index))
    causal = _CASES[index][1]
    mine = shard_positions(q.shape[2], _WORLD, rank)
    scores = q[:, :, mine] @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        scores = scores.masked_fill(torch.arange(q.shape[2])[None, :] > mine[:, None], float("-inf"))
    return scores.softmax(-1) @ v, torch.logsumexp(scores, -1)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    return got.shape == want.shape and bool(torch.isclose(got.double(), want.double(), atol=tol, rtol=tol).all())


def _wrong_outputs(partials: tuple) -> list[tuple[torch.Tensor, str, str]]:
    """The typical wrong merges of these partials (float64), each with its name and a hint."""
    out_a, lse_a, out_b, lse_b = (t.double() for t in partials)
    top = torch.maximum(lse_a, lse_b)
    wa, wb = torch.exp(lse_a - top)[..., None], torch.exp(lse_b - top)[..., None]
    return [
        ((out_a + out_b) / 2, "the two outputs were averaged",
         "a block whose keys score higher must weigh more: each output is a mean over its own block only, "
         "and its weight is its share of the whole softmax's denominator"),
        ((out_a * lse_a[..., None] + out_b * lse_b[..., None]) / (lse_a + lse_b)[..., None],
         "the outputs were weighted by their lse", "lse is the LOG of a block's denominator: the weights are the "
         "denominators themselves, exp(lse), as a share of their sum"),
        (out_a * wa + out_b * wb, "the weights do not add up to 1",
         "each block's weight is exp(lse_x) divided by the sum of both: the merged output is a weighted mean"),
    ]


def _diagnose(index: int, rank: int, answer: Any, partials: tuple) -> tuple[str, str]:
    """(what is wrong, hint) for rank ``rank``'s merge in case ``index``; ("", "") when it is right."""
    want_out, want_lse = _reference(index, rank)
    if not isinstance(answer, tuple):
        return (f"rank {rank} returned {answer}, not a pair of tensors",
                "return (out, lse): the merged output and its log-denominator, which the next ring step merges again")
    out, lse = answer
    if out.shape != want_out.shape or lse.shape != want_lse.shape:
        return (f"rank {rank} returned shapes {tuple(out.shape)} and {tuple(lse.shape)}, expected "
                f"{tuple(want_out.shape)} and {tuple(want_lse.shape)}", "out like out_a, lse like lse_a")
    if not bool(torch.isfinite(out).all()):
        if index == 2:
            return (f"rank {rank}'s output is not finite: exp(lse) overflowed (lse is up to "
                    f"{float(want_lse.max()):.0f} here, float32's exp ends at 88)",
                    "shift both lse by the larger of the two before exp: the weights, a ratio, do not change")
        return (f"rank {rank}'s output holds NaN where a query saw no key of one block (lse = -inf)",
                "a block a query cannot see must get weight 0: exp(-inf - a finite number) is 0, but -inf - (-inf) "
                "is NaN")
    if not _close(out, want_out, _TOL["out"]):
        for value, what, hint in _wrong_outputs(partials):
            if _close(out, value, _TOL["out"]):
                return what, hint
        worst = float((out.double() - want_out).abs().max())
        return (f"rank {rank}'s merged output differs from attention over all keys by up to {worst:.3g}",
                "out = out_a · exp(lse_a − lse) + out_b · exp(lse_b − lse), with lse the log of both denominators' sum")
    if not bool(torch.isfinite(lse[torch.isfinite(want_lse)]).all()):
        return (f"rank {rank}'s lse is not finite where the whole attention's is (up to {float(want_lse.max()):.0f}): "
                "exp overflowed", "log(e^a + e^b) = m + log(e^(a−m) + e^(b−m)) with m the larger: no overflow")
    if not _close(lse, want_lse, _TOL["lse"]):
        a, b = partials[1].double(), partials[3].double()
        for value, what in ((torch.maximum(a, b), "lse is the larger of the two lse"),
                            (a + b, "lse is the sum of the two lse"), ((a + b) / 2, "lse is the mean of the two lse")):
            if _close(lse, value, _TOL["lse"]):
                return (what, "lse is the log of the whole denominator: the two blocks' denominators exp(lse_a) and "
                        "exp(lse_b) add up")
        return (f"rank {rank}'s lse differs from log Σ exp(scores) over all keys by up to "
                f"{float((lse.double() - want_lse).abs().max()):.3g}", "lse = log(exp(lse_a) + exp(lse_b))")
    return "", ""


def check_merge_attention(fn: Any) -> CheckResult:
    """Check ``merge_attention`` as one ring step on 2 gloo ranks against attention over all keys (3 cases)."""
    name = "merge_attention"
    require_callable(fn, name)
    if is_stub(fn):
        return stub_result(name, name)
    results = run_on_ranks(name, fn, _merge_rank, _WORLD)
    if isinstance(results, CheckResult):
        return results
    for index, (label, _, _) in enumerate(_CASES):
        for rank in range(_WORLD):
            found = results[rank][index]
            what, hint = _diagnose(index, rank, found["answer"], found["partials"])
            if what:
                return failed(name, repr(label), what, hint)
    return passed(name, f"{len(_CASES)} cases on {_WORLD} gloo ranks (no mask, a block a query cannot see, "
                  "scores beyond exp's range)")
