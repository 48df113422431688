"""Ulysses (DeepSpeed): trade the sequence split for a head split with two all-to-alls.

Attention mixes tokens but never heads: each head is an independent attention over the
whole sequence. So instead of passing key blocks round a ring, every rank can swap its
sequence shard of *all* heads for the whole sequence of *some* heads, attend locally, and swap
back::

    q, k, v (b, n, s/cp, d)  ─ all-to-all ─  (b, n/cp, s, d)  ─ attention (whole sequence) ─
    out (b, n/cp, s, d)      ─ all-to-all ─  (b, n, s/cp, d)

Rank j sends rank i its tokens of heads ``i·n/cp … (i+1)·n/cp``; the sequence arrives in rank
order, with every rank's positions (:mod:`.layout`), so the causal mask holds for the zig-zag
split too. The constraint: **heads divisible by cp** (GPT-2 small's 12 heads allow cp 2, 3, 4,
6, 12, not 8); the ring has none. Traffic per rank and pass: two all-to-alls forward (q, k, v
in one, the output), two backward, each sending (cp − 1)/cp of its tensor: per rank it falls
as 1/cp, where the ring sends about the whole sequence's keys and values whatever cp (:mod:`.cost`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from parallel_lib.common.checks import check_choice, positive_int, positive_number
from parallel_lib.context_parallel.layout import LAYOUTS, shard_positions
from parallel_lib.context_parallel.ring import cp_group_of, timed_wait
from parallel_lib.context_parallel.tiled import TileWork, check_qkv, tiled_backward, tiled_forward

__all__ = ["check_ulysses", "seq_to_heads", "heads_to_seq", "ulysses_attention"]


def check_ulysses(heads: int, cp: int) -> None:
    """Check Ulysses' constraint.

    Raises:
        ValueError: ``heads`` not divisible by ``cp``, naming both and what to do.
    """
    heads, cp = positive_int("heads", heads), positive_int("cp", cp)
    if heads % cp:
        fits = [c for c in range(1, heads + 1) if heads % c == 0]
        raise ValueError(f"Ulysses gives each rank heads/cp whole heads: heads={heads} is not divisible by "
                         f"cp={cp}; use cp in {fits}, or ring attention (any cp)")


def _all_to_all(x: torch.Tensor, group: Any, timeout: float, what: str) -> torch.Tensor:
    """``x`` (cp, ...) split along dim 0: piece i goes to rank i, piece i of the result came from rank i."""
    x = x.contiguous()
    out = torch.empty_like(x)
    work = dist.all_to_all_single(out, x, group=group, async_op=True)
    where = f"cp index {dist.get_rank(group)} of {dist.get_world_size(group)}"
    timed_wait([work], timeout, f"rank {dist.get_rank()} ({where}): {what}")
    return out


def seq_to_heads(x: torch.Tensor, group: Any, timeout: float = 60.0) -> torch.Tensor:
    """(…, b, n, s/cp, d) sequence shards → (…, b, n/cp, s, d): my heads, every rank's tokens in rank order.

    The leading dimensions (e.g. q, k, v stacked) travel in the same all-to-all.
    """
    cp = dist.get_world_size(group)
    *lead, b, n, s, d = x.shape
    pieces = x.reshape(*lead, b, cp, n // cp, s, d).movedim(-4, 0)              # (cp, …, b, n/cp, s/cp, d)
    got = _all_to_all(pieces, group, timeout, "sequence → heads all-to-all")     # piece i: rank i's tokens
    return got.movedim(0, -3).reshape(*lead, b, n // cp, cp * s, d)            # (…, b, n/cp, s, d)


def heads_to_seq(x: torch.Tensor, group: Any, timeout: float = 60.0) -> torch.Tensor:
    """(…, b, n/cp, s, d) → (…, b, n, s/cp, d): the inverse of :func:`seq_to_heads`."""
    cp = dist.get_world_size(group)
    *lead, b, h, s, d = x.shape
    pieces = x.reshape(*lead, b, h, cp, s // cp, d).movedim(-3, 0)             # (cp, …, b, n/cp, s/cp, d)
    got = _all_to_all(pieces, group, timeout, "heads → sequence all-to-all")     # piece i: rank i's heads
    return got.movedim(0, -4).reshape(*lead, b, cp * h, s // cp, d)


class _UlyssesAttention(torch.autograd.Function):
    """Forward: all-to-all q, k, v; tiled attention on my heads; all-to-all back. Backward: the mirror."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, causal: bool,
                layout: str, block: int, scale: Optional[float], timeout: float,
                work: Optional[TileWork]) -> torch.Tensor:
        cp, local = dist.get_world_size(group), q.shape[2]
        positions = torch.cat([shard_positions(local * cp, cp, i, layout, q.device) for i in range(cp)])
        qh, kh, vh = seq_to_heads(torch.stack([q, k, v]), group, timeout).unbind(0)   # (b, n/cp, s, d) each
        out, lse = tiled_forward(qh, kh, vh, causal, positions, positions, block, scale, work)
        ctx.save_for_backward(qh, kh, vh, out, lse, positions)
        ctx.group, ctx.causal, ctx.block, ctx.scale, ctx.timeout = group, causal, block, scale, timeout
        return heads_to_seq(out.to(q.dtype), group, timeout)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        qh, kh, vh, out, lse, positions = ctx.saved_tensors
        dout_h = seq_to_heads(dout, ctx.group, ctx.timeout)
        grads = tiled_backward(dout_h, qh, kh, vh, out, lse, ctx.causal, positions, positions, ctx.block, ctx.scale)
        dq, dk, dv = heads_to_seq(torch.stack(grads).to(qh.dtype), ctx.group, ctx.timeout).unbind(0)
        return dq, dk, dv, None, None, None, None, None, None, None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, causal: bool = False,
                      layout: str = "contiguous", block: int = 64, scale: Optional[float] = None,
                      timeout: float = 60.0, work: Optional[TileWork] = None) -> torch.Tensor:
    """Attention of this rank's tokens through a head split (module docstring); same contract as ring attention.

    Args:
        q, k, v: (b, n, s/cp, d), this rank's tokens in ``layout``'s order.
        group: the ``cp`` process group, or a built mesh.
        causal, layout, block, scale, timeout, work: as :func:`.ring.ring_attention`.

    Returns:
        (b, n, s/cp, d), this rank's part of the output.

    Raises:
        ValueError: heads not divisible by the group's size (Ulysses' constraint); bad shapes or options.
        TypeError: bad tensors, or ``group=None``.
        TimeoutError: an all-to-all did not finish within ``timeout``; names this rank.
    """
    check_qkv(q, k, v)
    if q.shape != k.shape:
        raise ValueError(f"q and k, v must hold the same tokens (s/cp each), got q={tuple(q.shape)}, "
                         f"k={tuple(k.shape)}")
    group = cp_group_of(group)
    check_ulysses(q.shape[1], dist.get_world_size(group))
    check_choice("layout", layout, LAYOUTS)
    positive_int("block", block)
    positive_number("timeout", timeout)
    return _UlyssesAttention.apply(q, k, v, group, bool(causal), layout, block, scale, float(timeout), work)
