"""Ring attention: every rank keeps s/cp of the queries; the keys and values travel round the ring.

A rank's queries need every key of the sequence, but no rank needs them all at once: attention
over the keys in blocks is exact once the blocks' partial results are merged by their
log-sum-exp (:func:`merge_partials`, the same rescaling as the running maximum of
:mod:`.tiled`, for two finished blocks). So each of the cp ranks of the ``cp`` group holds
its own queries and passes key/value blocks to its right-hand neighbour, cp − 1 times::

    step t on rank r (block of rank r − t in hand):
        [1] post one batch_isend_irecv: my block → rank r + 1, the next block ← rank r − 1
        [2] attend my queries to the block in hand (tiles; a tile wholly in the future is skipped)
        [3] merge the block's (out, lse) into the running ones
        [4] wait for the batch (timeout naming the rank): the next block is in hand

The transfer is posted before the block's compute, so on a GPU it hides behind it when a
step's attention takes longer than moving a block (chapter's cost section).

**Backward** (a custom ``autograd.Function``): the rank keeps its q, k, v, out and lse, and
sends its k, v round the ring again. Each block's dK, dV collect a contribution from every
rank's queries, so an accumulator travels *with* the block: at step t a rank adds its part to
the accumulator that arrived with the block, and hands it on one step later; after cp sends
it is back at the block's owner, complete. Per rank: cp − 1 key/value sends forward, cp − 1
key/value sends and cp dK/dV sends backward (:mod:`.cost` counts them against the
collective counter). dQ stays local.

**The step record** (``record=``): one :class:`RingEvent` per rank and step, what was in hand,
what was sent and how many tiles were computed. The chapter's widget replays it, and the tests
replay it to check that every block met every rank's queries and every dK/dV came home whole.

**Causal masking** uses positions (:mod:`.layout`): a block whose keys all come after every
query of this rank costs nothing, which is why the contiguous split leaves the first ranks
idle and the zig-zag split does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from parallel_lib.common.checks import check_choice, positive_int, positive_number
from parallel_lib.context_parallel.layout import LAYOUTS, shard_positions
from parallel_lib.context_parallel.tiled import TileWork, check_qkv, tiled_backward, tiled_forward
from parallel_lib.runtime.mesh import RankMesh
from parallel_lib.runtime.waiting import wait_for

__all__ = ["RingEvent", "cp_group_of", "merge_partials", "ring_attention", "timed_wait"]


@dataclass(frozen=True)
class RingEvent:
    """One step of one rank, as ring attention ran it: the record a widget replays and a test checks.

    Backward has one step more than forward (step ``cp``): the last dK/dV accumulator goes home
    (``block`` is then the block whose accumulator is sent, and nothing is computed).
    """

    direction: str             # "forward" or "backward"
    step: int                  # t = 0 .. cp - 1 (backward: .. cp)
    rank: int                  # this rank's index along cp
    block: int                 # the cp index of the rank whose key/value block is in hand
    sends: tuple[str, ...]     # what this step's one batch_isend_irecv sent right: "kv", "dkv"
    tiles: int                 # tiles of attention computed on the block (TileWork.tiles)


def cp_group_of(mesh_or_group: Any) -> Any:
    """The context-parallel process group: ``mesh.group("cp")`` of a ``RankMesh``, or the group itself.

    Raises:
        TypeError: ``None`` (the default group is never used implicitly: take the group from the mesh).
    """
    if isinstance(mesh_or_group, RankMesh):
        return mesh_or_group.group("cp")
    if mesh_or_group is None:
        raise TypeError("group must be the context-parallel group (mesh.group('cp')) or a built mesh, got None")
    return mesh_or_group


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over two key blocks from attention over each: weights ``exp(lse_part − lse)``.

    ``out_x`` (…, s, d) is the softmax-weighted mean of block x's values, ``lse_x`` (…, s) the
    log of its softmax's sum; the union's normaliser is ``lse = log(e^lse_a + e^lse_b)`` and its
    output the two means weighted by each block's share of it. A query that saw nothing in a
    block has ``lse = -inf`` there and weight 0.

    Returns:
        ``(out, lse)`` of the union.

    Raises:
        ValueError: shapes that do not match.
    """
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or out_a.shape[:-1] != lse_a.shape:
        raise ValueError(f"out_a, out_b must be (..., s, d) and lse_a, lse_b (..., s) alike, got "
                         f"{tuple(out_a.shape)}, {tuple(out_b.shape)}, {tuple(lse_a.shape)}, {tuple(lse_b.shape)}")
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)          # both -inf: weights 0, not NaN
    out = out_a * torch.exp(lse_a - safe)[..., None] + out_b * torch.exp(lse_b - safe)[..., None]
    return out, lse


def timed_wait(works: Sequence[Any], timeout: float, what: str) -> None:
    """Wait for each of ``works`` (each once: gloo hangs on a second wait) at most ``timeout`` seconds each.

    Raises:
        TimeoutError: nothing came in time; the message says ``what`` waited (name the rank in it).
        RuntimeError: the peer failed first.
    """
    for work in works:
        wait_for(work, timeout, what)


class _Ring:
    """One rank's place in the ring: neighbours, positions, and the one batched exchange per step."""

    def __init__(self, group: Any, layout: str, local: int, timeout: float, device: torch.device) -> None:
        self.group, self.layout, self.timeout, self.device = group, layout, timeout, device
        self.index, self.cp = dist.get_rank(group), dist.get_world_size(group)
        self.rank = dist.get_rank()
        self.right = dist.get_global_rank(group, (self.index + 1) % self.cp)
        self.left = dist.get_global_rank(group, (self.index - 1) % self.cp)
        self.seq_len = local * self.cp

    def positions(self, index: int) -> torch.Tensor:
        """The positions of the tokens cp rank ``index`` holds."""
        return shard_positions(self.seq_len, self.cp, index % self.cp, self.layout, self.device)

    def note(self, record: Optional[list], work: Optional[TileWork], direction: str, step: int,
             sends: tuple[str, ...], done: TileWork) -> None:
        """Add a step's tiles to ``work`` and its :class:`RingEvent` to ``record`` (either may be None)."""
        if work is not None:
            work.add(done)
        if record is not None:
            home = step == self.cp                 # backward's extra step: the accumulator of last step's block
            block = (self.index - step + home) % self.cp
            record.append(RingEvent(direction, step, self.index, block, sends, done.tiles))

    def post(self, sends: list[torch.Tensor]) -> tuple[list[Any], list[torch.Tensor]]:
        """[1] One ``batch_isend_irecv``: each tensor → right-hand neighbour, one like it ← left-hand one."""
        inbox = [torch.empty_like(t) for t in sends]
        ops = ([dist.P2POp(dist.isend, t, self.right, self.group) for t in sends]
               + [dist.P2POp(dist.irecv, t, self.left, self.group) for t in inbox])
        return dist.batch_isend_irecv(ops), inbox

    def finish(self, pending: tuple[list[Any], list[torch.Tensor]], what: str) -> list[torch.Tensor]:
        """[4] Wait for a posted exchange; return what arrived."""
        works, inbox = pending
        timed_wait(works, self.timeout, f"rank {self.rank} (cp index {self.index} of {self.cp}): {what} "
                                        f"from rank {self.left}")
        return inbox


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, causal: bool,
                layout: str, block: int, scale: Optional[float], timeout: float,
                work: Optional[TileWork], record: Optional[list]) -> torch.Tensor:
        ring = _Ring(group, layout, q.shape[2], timeout, q.device)
        q_pos = ring.positions(ring.index)
        kv = torch.stack([k, v]).contiguous()                                  # (2, b, n, s/cp, d): one message
        out: Optional[torch.Tensor] = None
        lse: Optional[torch.Tensor] = None
        for t in range(ring.cp):
            pending = ring.post([kv]) if t < ring.cp - 1 else None             # [1] before the compute
            tiles = TileWork()
            o, l = tiled_forward(q, kv[0], kv[1], causal, q_pos, ring.positions(ring.index - t), block, scale,
                                 tiles)                                         # [2]
            out, lse = (o, l) if out is None else merge_partials(out, lse, o, l)  # [3]
            ring.note(record, work, "forward", t, ("kv",) if pending else (), tiles)
            if pending is not None:
                kv = ring.finish(pending, f"forward step {t}: the key/value block")[0]   # [4]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.causal, ctx.block, ctx.scale, ctx.record = ring, causal, block, scale, record
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        q, k, v, out, lse = ctx.saved_tensors
        ring: _Ring = ctx.ring
        q_pos = ring.positions(ring.index)
        kv = torch.stack([k, v]).contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        done: Optional[torch.Tensor] = None       # the dK/dV accumulator of the block finished last step (fp32)
        for t in range(ring.cp):
            sending = ([("kv", kv)] if t < ring.cp - 1 else []) + ([("dkv", done)] if done is not None else [])
            pending = ring.post([tensor for _, tensor in sending]) if sending else None
            recomputed = TileWork()
            dq_t, dk_t, dv_t = tiled_backward(dout, q, kv[0], kv[1], out, lse, ctx.causal, q_pos,
                                              ring.positions(ring.index - t), ctx.block, ctx.scale, recomputed)
            ring.note(ctx.record, None, "backward", t, tuple(name for name, _ in sending), recomputed)
            dq += dq_t
            mine = torch.stack([dk_t, dv_t])
            if pending is not None:
                arrived = ring.finish(pending, f"backward step {t}: the key/value block and its dK/dV")
                if t < ring.cp - 1:
                    kv = arrived[0]
                if done is not None:
                    mine = mine + arrived[-1]      # the block's accumulator, from the ranks it visited before
            done = mine
        assert done is not None
        if ring.cp > 1:                            # the last accumulator goes home: the right-hand rank owns it
            pending = ring.post([done])
            ring.note(ctx.record, None, "backward", ring.cp, ("dkv",), TileWork())
            done = ring.finish(pending, "the last dK/dV step: my block's dK/dV")[0]
        return (dq.to(q.dtype), done[0].to(k.dtype), done[1].to(v.dtype),
                None, None, None, None, None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, causal: bool = False,
                   layout: str = "contiguous", block: int = 64, scale: Optional[float] = None,
                   timeout: float = 60.0, work: Optional[TileWork] = None,
                   record: Optional[list] = None) -> torch.Tensor:
    """Attention of this rank's queries on the whole sequence, the keys and values passed round ``group``.

    Every rank of the group calls it with its own shard (:func:`.layout.shard_sequence` of q,
    k and v along dim 2); the outputs are the shards of full attention's output, and the
    gradients of q, k, v those of full attention (module docstring).

    Args:
        q, k, v: (b, n, s/cp, d), this rank's tokens in ``layout``'s order.
        group: the ``cp`` process group, or a built mesh (:func:`cp_group_of`).
        causal: query at position i sees keys at positions <= i.
        layout: "contiguous" or "zigzag" (:mod:`.layout`); every rank the same.
        block: tile size of the attention inside each step (:mod:`.tiled`).
        scale: default ``d ** -0.5``.
        timeout: seconds any exchange may wait.
        work: if given, the tiles this rank computes forward are added to it.
        record: if given, a list this rank's :class:`RingEvent` of every step (forward, then
            backward) is appended to.

    Returns:
        (b, n, s/cp, d), this rank's part of the output.

    Raises:
        TypeError: bad tensors, or ``group=None``.
        ValueError: shapes that differ between q and k, v (every rank holds s/cp of each); bad
            ``layout``, ``block`` or ``timeout``; s/cp odd (two chunks per rank).
        TimeoutError: a neighbour's block did not come within ``timeout``; names this rank.
    """
    check_qkv(q, k, v)
    if q.shape != k.shape:
        raise ValueError(f"q and k, v must hold the same tokens of the sequence (s/cp each), got "
                         f"q={tuple(q.shape)}, k={tuple(k.shape)}")
    group = cp_group_of(group)
    check_choice("layout", layout, LAYOUTS)
    positive_int("block", block)
    positive_number("timeout", timeout)
    if q.shape[2] % 2:
        raise ValueError(f"each rank holds two chunks of the sequence, so s/cp must be even, got "
                         f"{q.shape[2]} tokens per rank; pad the sequence to a multiple of 2·cp")
    return _RingAttention.apply(q, k, v, group, bool(causal), layout, block, scale, float(timeout), work, record)
