"""Attention in tiles: softmax over key blocks with a running maximum and sum (the idea behind FlashAttention).

Softmax attention writes the whole score matrix ``q kᵀ`` (b, n, s, s) and keeps the
probabilities for the backward pass: memory that grows with s², the first thing to run out
when the sequence gets long. Nothing forces it. A row's softmax can be built one key block
at a time, keeping per query only three things::

    m    the largest score seen so far           (running maximum: exp never overflows)
    l    Σ exp(score − m) over the keys seen      (running sum)
    acc  Σ exp(score − m) · v over the keys seen  (unnormalised output)

    for each key block j:                          [1] scores of this tile only: (tile, tile)
        m' = max(m, rowmax(S_j))                   [2] a new maximum rescales what came before
        l   = l · e^(m − m') + rowsum(e^(S_j − m'))
        acc = acc · e^(m − m') + e^(S_j − m') V_j
    out = acc / l,   lse = m + log l               [3] lse: the softmax's log-normaliser, per query

The backward pass recomputes each tile's probabilities from ``lse`` instead of storing them
(``P = exp(S − lse)``; with ``D = rowsum(dO ∘ O)``, ``dS = P ∘ (dO Vᵀ − D)``), so autograd keeps
q, k, v, the output and ``lse``: (b, n, s, d) tensors, no s² one (:func:`saved_attention_bytes`
counts it). The same two loops serve ring attention (:mod:`.ring`), where a "block" is a
neighbour's keys: they take the positions of the queries and keys, so a causal mask holds
whatever part of the sequence a rank has, and a tile whose keys all lie in its queries' future
is skipped (not computed: :class:`TileWork` counts what was).

Everything runs in fp32 inside (the running sums would lose precision in bf16), then returns
to the inputs' dtype. Written in PyTorch for reading, not for speed: FlashAttention does the
same in one GPU kernel, with the tiles in on-chip memory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from parallel_lib.common.saved_tensors import SavedTensors
from parallel_lib.common.checks import positive_int

__all__ = ["TileWork", "full_attention", "tiled_forward", "tiled_backward", "tiled_attention",
           "saved_attention_bytes", "check_qkv"]


@dataclass
class TileWork:
    """What the tile loops computed: count it to see who works how much (:mod:`.layout`)."""

    tiles: int = 0    # (query tile, key tile) pairs computed; fully masked ones are skipped
    entries: int = 0  # score entries computed (the tiles' areas): the work a GPU kernel does
    allowed: int = 0  # of those, the entries the mask allows: the useful work
    seconds: float = 0.0  # CPU time of this thread in the forward tile loops: a rank's compute on one thread, not
    #                       the time others took the core (a GPU's kernels run elsewhere: there, the host's share)

    def add(self, other: "TileWork") -> None:
        self.tiles, self.entries, self.allowed = (self.tiles + other.tiles, self.entries + other.entries,
                                                  self.allowed + other.allowed)
        self.seconds += other.seconds


def check_qkv(q: Any, k: Any, v: Any) -> None:
    """Check that ``q``, ``k``, ``v`` are (b, n, s, d) tensors that fit together.

    Raises:
        TypeError: one is not a tensor.
        ValueError: not 4-d, or shapes that do not match (batch, heads, head size; k and v alike).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor (batch, heads, seq, head_dim), got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-d (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q, k, v must share batch, heads and head_dim, and k, v one shape; got "
                         f"q={tuple(q.shape)}, k={tuple(k.shape)}, v={tuple(v.shape)}")


def _positions(pos: Optional[torch.Tensor], n: int, device: torch.device, name: str) -> torch.Tensor:
    if pos is None:
        return torch.arange(n, device=device)
    if not isinstance(pos, torch.Tensor) or pos.dim() != 1 or pos.numel() != n:
        raise ValueError(f"{name} must be a 1-d tensor of {n} positions, got "
                         f"{tuple(pos.shape) if isinstance(pos, torch.Tensor) else type(pos).__name__}")
    return pos.to(device)


def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                   q_pos: Optional[torch.Tensor] = None, k_pos: Optional[torch.Tensor] = None,
                   scale: Optional[float] = None) -> torch.Tensor:
    """Softmax attention as the model writes it, the whole (b, n, sq, sk) score matrix at once: the reference.

    Args:
        q: (b, n, sq, d) queries; k, v: (b, n, sk, d) keys and values.
        causal: a query at position i sees keys at positions <= i.
        q_pos, k_pos: the tokens' positions in the sequence (default ``0..s-1``).
        scale: multiplies the scores (default ``d ** -0.5``).

    Returns:
        (b, n, sq, d), in q's dtype (a query that may see no key gets NaN, as a softmax of nothing).

    Raises:
        TypeError, ValueError: see :func:`check_qkv`; positions of the wrong length.
    """
    check_qkv(q, k, v)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale                 # (b, n, sq, sk): s² of them
    if causal:
        qp = _positions(q_pos, q.shape[2], q.device, "q_pos")
        kp = _positions(k_pos, k.shape[2], k.device, "k_pos")
        allowed = kp[None, :] <= qp[:, None]                                      # (sq, sk)
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = scores.softmax(dim=-1)                                               # kept for backward: s²
    return (probs @ v.float()).to(q.dtype)


def _tiles(n: int, block: int) -> list[slice]:
    return [slice(i, min(i + block, n)) for i in range(0, n, block)]


def _tile_mask(host: tuple[torch.Tensor, torch.Tensor], qp: torch.Tensor, kp: torch.Tensor, qi: slice, kj: slice,
               causal: bool) -> tuple[int, Optional[torch.Tensor]]:
    """``(allowed entries, mask)`` of a tile: 0 entries for a tile wholly in the future (skip it), no mask when
    every entry is allowed. Decided on the host's copy of the positions: no device sync per tile on a GPU."""
    area = (qi.stop - qi.start) * (kj.stop - kj.start)
    if not causal:
        return area, None
    allowed = int((host[1][None, kj] <= host[0][qi, None]).sum())
    if allowed in (0, area):
        return allowed, None
    return allowed, kp[None, kj] <= qp[qi, None]                                   # (tq, tk) on the device


def _safe(m: torch.Tensor) -> torch.Tensor:
    """``m`` with -inf (no key seen yet) replaced by 0, so that ``exp(x − m)`` stays 0, never NaN."""
    return torch.where(torch.isinf(m), torch.zeros_like(m), m)


def tiled_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                  q_pos: Optional[torch.Tensor] = None, k_pos: Optional[torch.Tensor] = None,
                  block: int = 64, scale: Optional[float] = None,
                  work: Optional[TileWork] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` on ``k``, ``v`` tile by tile, without autograd (see the module docstring, [1]-[3]).

    Args:
        q, k, v, causal, q_pos, k_pos, scale: as :func:`full_attention`.
        block: tile size along queries and keys.
        work: if given, the tiles computed are added to it.

    Returns:
        ``(out, lse)``: out (b, n, sq, d) fp32, lse (b, n, sq) fp32 (-inf for a query that sees no key).

    Raises:
        TypeError, ValueError: bad q, k, v or positions; ``block`` not a positive int.
    """
    check_qkv(q, k, v)
    block = positive_int("block", block)
    start = time.thread_time()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qp = _positions(q_pos, q.shape[2], q.device, "q_pos")
    kp = _positions(k_pos, k.shape[2], k.device, "k_pos")
    qf, kf, vf = q.float(), k.float(), v.float()
    out = torch.zeros(qf.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(qf.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    host = (qp.cpu(), kp.cpu())
    for qi in _tiles(q.shape[2], block):
        m = torch.full(qf.shape[:2] + (qi.stop - qi.start,), float("-inf"), device=q.device)   # (b, n, tq)
        l = torch.zeros_like(m)
        acc = torch.zeros(qf.shape[:2] + (qi.stop - qi.start, qf.shape[3]), device=q.device)   # (b, n, tq, d)
        for kj in _tiles(k.shape[2], block):
            count, allowed = _tile_mask(host, qp, kp, qi, kj, causal)
            if count == 0:
                continue                                                                     # all in the future
            if work is not None:
                work.add(TileWork(1, (qi.stop - qi.start) * (kj.stop - kj.start), count))
            s = (qf[:, :, qi] @ kf[:, :, kj].transpose(-1, -2)) * scale                     # [1] (b, n, tq, tk)
            if allowed is not None:
                s = s.masked_fill(~allowed, float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))                                         # [2]
            p = torch.exp(s - _safe(m_new)[..., None])
            rescale = torch.exp(m - _safe(m_new))
            l = l * rescale + p.sum(dim=-1)
            acc = acc * rescale[..., None] + p @ vf[:, :, kj]
            m = m_new
        seen = l > 0
        out[:, :, qi] = torch.where(seen[..., None], acc / torch.where(seen, l, 1.0)[..., None], 0.0)   # [3]
        lse[:, :, qi] = torch.where(seen, m + torch.log(torch.where(seen, l, 1.0)), float("-inf"))
    if work is not None:
        work.seconds += time.thread_time() - start
    return out, lse


def tiled_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, causal: bool = False, q_pos: Optional[torch.Tensor] = None,
                   k_pos: Optional[torch.Tensor] = None, block: int = 64, scale: Optional[float] = None,
                   work: Optional[TileWork] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of attention for ``q`` against these keys, from the softmax's ``lse``: tiles recomputed.

    ``out`` and ``lse`` are the *whole* attention's (over every key of the sequence), so the
    probabilities of a tile are final ones even when ``k``, ``v`` are only part of the keys
    (ring attention passes each block; the parts add up).

    Args:
        dout: (b, n, sq, d) gradient of the output; out, lse: as :func:`tiled_forward` returned them
            (for all keys); the rest: as :func:`tiled_forward` (``work`` counts the tiles recomputed).

    Returns:
        ``(dq, dk, dv)`` in fp32: dq the contribution of these keys, dk and dv those of these queries.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qp = _positions(q_pos, q.shape[2], q.device, "q_pos")
    kp = _positions(k_pos, k.shape[2], k.device, "k_pos")
    qf, kf, vf, do = q.float(), k.float(), v.float(), dout.float()
    delta = (do * out.float()).sum(dim=-1)                                     # D = rowsum(dO ∘ O): (b, n, sq)
    safe_lse = _safe(lse)
    dq, dk, dv = torch.zeros_like(qf), torch.zeros_like(kf), torch.zeros_like(vf)
    host = (qp.cpu(), kp.cpu())
    for qi in _tiles(q.shape[2], block):
        for kj in _tiles(k.shape[2], block):
            count, allowed = _tile_mask(host, qp, kp, qi, kj, causal)
            if count == 0:
                continue
            if work is not None:
                work.add(TileWork(1, (qi.stop - qi.start) * (kj.stop - kj.start), count))
            s = (qf[:, :, qi] @ kf[:, :, kj].transpose(-1, -2)) * scale
            if allowed is not None:
                s = s.masked_fill(~allowed, float("-inf"))
            p = torch.exp(s - safe_lse[:, :, qi, None])                          # the final probabilities
            dv[:, :, kj] += p.transpose(-1, -2) @ do[:, :, qi]
            ds = p * (do[:, :, qi] @ vf[:, :, kj].transpose(-1, -2) - delta[:, :, qi, None])
            dq[:, :, qi] += (ds @ kf[:, :, kj]) * scale
            dk[:, :, kj] += (ds.transpose(-1, -2) @ qf[:, :, qi]) * scale
    return dq, dk, dv


class _TiledAttention(torch.autograd.Function):
    """Keeps q, k, v, out and lse for backward, which recomputes every tile: no s² tensor is saved."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, block: int,
                scale: Optional[float], work: Optional[TileWork]) -> torch.Tensor:
        out, lse = tiled_forward(q, k, v, causal, block=block, scale=scale, work=work)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.block, ctx.scale = causal, block, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = tiled_backward(dout, q, k, v, out, lse, ctx.causal, block=ctx.block, scale=ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, block: int = 64,
                    scale: Optional[float] = None, work: Optional[TileWork] = None) -> torch.Tensor:
    """Softmax attention computed in tiles, forward and backward (equal to :func:`full_attention`).

    Args:
        q: (b, n, s, d); k, v: (b, n, sk, d); causal: query i sees keys <= i.
        block: tile size; scale: default ``d ** -0.5``; work: counts the tiles computed.

    Returns:
        (b, n, s, d) in q's dtype, differentiable in q, k and v.

    Raises:
        TypeError, ValueError: see :func:`check_qkv`; ``block`` not a positive int.
    """
    check_qkv(q, k, v)
    positive_int("block", block)
    return _TiledAttention.apply(q, k, v, bool(causal), block, scale, work)


def saved_attention_bytes(attention: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          **kwargs: Any) -> int:
    """Bytes autograd keeps for backward when ``attention(q, k, v, **kwargs)`` runs (its inputs left out).

    The census of what an attention adds to activation memory: full attention keeps its
    (b, n, s, s) probabilities, the tiled one its output and ``lse``.

    Raises:
        ValueError: none of q, k, v requires grad (nothing would be saved).
    """
    if not any(t.requires_grad for t in (q, k, v)):
        raise ValueError("q, k or v must require grad, else autograd saves nothing to count; "
                         "pass q.requires_grad_()")
    with SavedTensors(exclude=[q, k, v]) as saved:
        attention(q, k, v, **kwargs)
    return saved.nbytes
