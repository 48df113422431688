"""Exercises for chapter 11: the log-sum-exp merge of two partial attentions, on 2 gloo ranks (``ch11_merge``);
the zig-zag split's positions, against the library's layout; and a committed prediction of the busiest rank's
share of the causal work under the contiguous split, against a measurement: ring attention run on 4 gloo
ranks, each counting the score entries its steps computed.

The checkers compare with the library (:func:`parallel_lib.context_parallel.layout.shard_positions`, the
tiles :func:`parallel_lib.context_parallel.ring.ring_attention` computes on each rank), never with
``solutions.py``.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

from parallel_lib.context_parallel.layout import shard_positions, shard_sequence
from parallel_lib.context_parallel.ring import ring_attention
from parallel_lib.context_parallel.tiled import TileWork
from parallel_lib.exercises._core import (Case, CheckResult, Exercise, as_number, check_function, check_value,
                                         distinct, failed, passed, solution)
from parallel_lib.exercises.ch11_merge import MERGE_STUB, check_merge_attention
from parallel_lib.runtime.launcher import LaunchTimeoutError, RankError, launch
from parallel_lib.runtime.mesh import Mesh

__all__ = ["check_merge_attention", "check_zigzag_positions", "check_busiest_share", "measured_shares",
           "EXERCISES"]

ZIGZAG_STUB = '''\
def zigzag_positions(seq_len, cp, rank):
    """The positions of the tokens context-parallel rank `rank` (0 .. cp-1) holds under the zig-zag split.

    Cut the sequence 0 .. seq_len-1 into 2·cp chunks of equal length (seq_len is a multiple of 2·cp). Rank i
    takes the i-th chunk counted from the start and the i-th chunk counted from the end, so that under a
    causal mask a cheap chunk (early queries see few keys) pairs with an expensive one. Return the positions
    as a list of ints, in increasing order.
    """
    ...  # your code here
'''

SHARE_STUB = '''\
# Ring attention with a causal mask and the contiguous split (rank i holds the i-th quarter of the sequence),
# cp = 4 ranks, a sequence of 256 tokens. A query at position p may see p + 1 keys, and each rank computes
# the score entries its own queries may see. What fraction of all those entries does the BUSIEST rank compute?
# Commit to a number (a formula in cp is enough): the check runs ring attention on 4 gloo ranks, each counting
# the score entries its ring steps computed, and compares.
BUSIEST_SHARE = None  # your answer: a fraction between 0 and 1
'''

SHARE_JOB = dict(seq_len=256, cp=4, block=16)


def _positions(seq_len: int, cp: int, rank: int, layout: str = "zigzag") -> list[int]:
    return shard_positions(seq_len, cp, rank, layout).tolist()


def _normalise_positions(value: Any) -> list[int]:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError("a list of ints, e.g. [0, 1, 6, 7]")
    items = list(value)
    if any(isinstance(v, bool) or not isinstance(v, int) for v in items):
        raise TypeError("a list of ints (positions), e.g. [0, 1, 6, 7]")
    return items


def _zigzag_hint(args: tuple, got: Any) -> str:
    seq_len, cp, rank = args
    if not isinstance(got, list):
        return ""
    if got == _positions(seq_len, cp, rank, "contiguous"):
        return ("these are the contiguous split's positions (chunks 2i and 2i+1): under a causal mask the last "
                "rank then does about 2·cp − 1 times the first rank's work")
    c = seq_len // (2 * cp)
    if sorted(got) == _positions(seq_len, cp, rank) and got != sorted(got):
        return "the right positions, but not in increasing order: the chunk from the end comes last"
    if len(got) == 2 * c and got[:c] == list(range(rank * c, (rank + 1) * c)):
        if got[c:] == list(range((2 * cp - rank) * c, (2 * cp - rank + 1) * c)):
            return ("the second chunk is one too far: counted from the end, the i-th of 2·cp chunks is "
                    "chunk 2·cp − 1 − i")
        return "the first chunk is right; the second is chunk i counted from the END of the 2·cp chunks"
    if len(got) == 2 * (seq_len // cp) or len(got) == seq_len // cp // 2:
        return (f"a rank holds seq_len / cp = {seq_len // cp} positions: two chunks of seq_len / (2·cp) = {c} each")
    return f"rank i holds chunk i and chunk 2·cp − 1 − i of the 2·cp chunks of {c} tokens"


def _causal_work(positions: list[int]) -> int:
    """Score entries a causal mask allows for queries at ``positions`` (position p sees p + 1 keys)."""
    return sum(p + 1 for p in positions)


def check_zigzag_positions(fn: Any) -> CheckResult:
    """Check ``zigzag_positions`` against :func:`~parallel_lib.context_parallel.layout.shard_positions`."""
    name = "zigzag_positions"
    shapes = [(8, 2, 0), (8, 2, 1), (16, 4, 0), (16, 4, 3), (24, 3, 1), (64, 4, 2)]
    result = check_function(name, fn, name, [Case(s, _positions(*s)) for s in shapes],
                            normalise=_normalise_positions, hint=_zigzag_hint)
    if not result.passed:
        return result
    work = {_causal_work(fn(64, 4, r)) for r in range(4)}
    return passed(name, f"{len(shapes)} cases; with your split, every rank of cp = 4 on 64 tokens has "
                  f"{work.pop()} causal score entries to compute")


def _ring_work(rank: int, world_size: int, seq_len: int, block: int, timeout: float = 60.0) -> dict[str, int]:
    """Worker: the causal score entries this rank's ring steps computed forward, for each layout."""
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 1, seq_len, 4, generator=gen) for _ in range(3))
    allowed = {}
    with Mesh(cp=world_size).build(timeout=timeout) as pm, torch.no_grad():
        for layout in ("contiguous", "zigzag"):
            work = TileWork()
            mine = [shard_sequence(t, world_size, pm.index("cp"), layout, dim=2) for t in (q, k, v)]
            ring_attention(*mine, pm.group("cp"), causal=True, layout=layout, block=block, timeout=timeout, work=work)
            allowed[layout] = work.allowed
    return allowed


@lru_cache(maxsize=1)
def measured_shares(seq_len: int = SHARE_JOB["seq_len"], cp: int = SHARE_JOB["cp"],
                    block: int = SHARE_JOB["block"]) -> dict[str, list[float]]:
    """Each rank's share of the causal score entries, measured on ``cp`` gloo ranks running ring attention.

    Every rank runs the ring's forward on its shard of one sequence (both layouts) and counts
    the score entries its steps computed that the mask allows (:class:`TileWork`); the shares
    are each rank's count over all ranks'. Cached: the ranks start once per process.

    Returns:
        ``{"contiguous": [share of rank 0, ...], "zigzag": [...]}``.

    Raises:
        LaunchTimeoutError, RankError: the ranks did not start in time, or one failed (named).
    """
    ranks = launch(_ring_work, cp, seq_len, block, backend="gloo", timeout=120, threads_per_rank=1)
    return {layout: [r[layout] / sum(x[layout] for x in ranks) for r in ranks] for layout in ("contiguous", "zigzag")}


def check_busiest_share(answer: Any) -> CheckResult:
    """The predicted share against the busiest rank's measured share (within 2 %: a formula's rounding)."""
    name = "busiest_share"
    if answer is None or answer is Ellipsis:  # before measuring: a stub's check (and the grade cell) stays instant
        return check_value(name, answer, "BUSIEST_SHARE", None)
    try:
        shares = measured_shares()
    except (LaunchTimeoutError, RankError) as error:   # a busy machine, not the student's mistake
        return failed(name, None, str(error).splitlines()[0], "run the check again when the machine is quieter")
    expected, idlest = max(shares["contiguous"]), min(shares["contiguous"])
    cp, seq_len = SHARE_JOB["cp"], SHARE_JOB["seq_len"]

    def compare(want: float, got: float) -> Any:
        return None if abs(got - want) <= 0.02 * want else f"measured {', you predicted '.join(distinct(want, got))}"

    def hint(got: float) -> str:
        ratio = expected / idlest
        if got > 1 and abs(got / 100 - expected) <= 0.02 * expected:
            return "a fraction between 0 and 1, not per cent"
        if abs(got - ratio) <= 0.1 * ratio or abs(got - (2 * cp - 1)) < 0.5:
            return ("that is the busiest rank's work over the idlest's (about 2·cp − 1); the question asks for its "
                    "share of ALL the entries")
        if abs(got - 1 / cp) < 1e-3:
            return ("1/cp is every rank's share under the zig-zag split (or without a mask); with the contiguous "
                    "split the last rank's queries see the most keys")
        if abs(got - idlest) <= 0.1 * idlest or abs(got - 1 / cp**2) < 1e-3:
            return ("that is rank 0's share, the idlest: its queries come first and see the fewest keys; the busiest "
                    "is the last rank")
        no_mask = (seq_len // cp) * seq_len / (seq_len * (seq_len + 1) / 2)
        if abs(got - no_mask) <= 0.02 * no_mask or abs(got - 2 / cp) < 1e-3:
            return ("you let each of the last rank's s/cp queries see all s keys; under the causal mask the query at "
                    "position p sees p + 1 of them")
        if got < expected:
            return "the last rank's queries are the latest positions: each sees almost the whole sequence"
        return ("rank i's queries are positions i·s/cp .. (i+1)·s/cp − 1; add p + 1 over the last rank's and divide "
                "by s(s + 1)/2")

    result = check_value(name, answer, "BUSIEST_SHARE", expected, normalise=as_number, compare=compare, hint=hint)
    if not result.passed:
        return result
    return passed(name, f"1 case: measured on {cp} gloo ranks, {expected:.4f} for rank {cp - 1} of {cp} (contiguous: "
                  f"{', '.join(f'{x:.4f}' for x in shares['contiguous'])}); zig-zag's ranks: "
                  f"{', '.join(f'{x:.4f}' for x in shares['zigzag'])}")


EXERCISES = [
    Exercise("merge_attention", check_merge_attention, MERGE_STUB, solution("merge_attention"),
             "Write the log-sum-exp merge of two partial attentions, the step that makes ring attention exact. The "
             "checker runs it as one ring step on 2 gloo ranks (each attends to its own key block, receives the "
             "other's and merges) and compares with attention over all keys, with a causal mask and with scores "
             "large enough to overflow `exp`."),
    Exercise("zigzag_positions", check_zigzag_positions, ZIGZAG_STUB, solution("zigzag_positions"),
             "Write the zig-zag split: which positions of the sequence each context-parallel rank holds. The checker "
             "compares with the library's `shard_positions` and counts your split's causal work per rank."),
    Exercise("busiest_share", check_busiest_share, SHARE_STUB, solution("BUSIEST_SHARE"),
             "Predict the busiest rank's share of the causal work under the contiguous split; the checker runs "
             "ring attention on 4 gloo ranks, each counting the score entries its ring steps compute, and "
             "compares (section 4 measured the same at 128 tokens)."),
]
