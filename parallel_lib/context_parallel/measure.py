"""Measuring context parallelism: memory kept for backward and time per step, against sequence length.

What the chapter plots and ``python -m parallel_lib.bench context`` prints. For each sequence
length it runs one attention forward and backward (q, k, v of ``batch × heads × s × head_dim``,
causal, fp32) and records, per rank:

- ``saved_bytes``: what autograd keeps for backward beyond q, k, v (the census,
  :class:`~parallel_lib.common.activations.SavedTensors`), beside :func:`.cost.attention_saved_bytes`;
- ``seconds``: the median wall time of forward plus backward;
- ``tiles``: the attention tiles computed forward (:class:`.tiled.TileWork`): the work;
- ``wire_bytes``: bytes sent, forward and backward (the collective counter), beside :func:`.cost.cp_wire_bytes`.

"full" and "tiled" run in this process; "ring" (contiguous and zig-zag) and "ulysses" run on
``cp`` gloo ranks, one launch per cp holding every length. On a shared CPU the times are noisy
and the transfers are memory copies: the memory and the work are the lesson. Every ring step
waits for the slowest rank, so the ranks' times come out alike: the imbalance of the contiguous
split shows in its total time against zig-zag's, and in the tiles.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch

from parallel_lib.common.activations import SavedTensors
from parallel_lib.common.checks import positive_int
from parallel_lib.context_parallel.layout import shard_sequence
from parallel_lib.context_parallel.ring import ring_attention
from parallel_lib.context_parallel.tiled import TileWork, full_attention, tiled_attention
from parallel_lib.context_parallel.ulysses import ulysses_attention
from parallel_lib.runtime.collectives import count_collectives
from parallel_lib.runtime.launcher import launch
from parallel_lib.runtime.mesh import Mesh

__all__ = ["Shape", "Measured", "measure_one_process", "measure_on_ranks", "measure_context"]

# (method, layout) pairs run on ranks
RANK_RUNS = (("ring", "contiguous"), ("ring", "zigzag"), ("ulysses", "contiguous"))


@dataclass(frozen=True)
class Shape:
    """The attention measured: its size but for the sequence length, the tile size and the repeats."""

    batch: int = 1
    heads: int = 4
    head_dim: int = 16
    block: int = 32
    repeats: int = 3

    def __post_init__(self) -> None:
        for name in ("batch", "heads", "head_dim", "block", "repeats"):
            positive_int(name, getattr(self, name))


@dataclass(frozen=True)
class Measured:
    """One method at one sequence length: per-rank numbers (one entry in this process)."""

    method: str                  # "full", "tiled", "ring", "ulysses"
    layout: str                  # "contiguous" or "zigzag" ("-" in one process)
    cp: int
    seq_len: int
    saved_bytes: tuple[int, ...]
    seconds: tuple[float, ...]
    tiles: tuple[int, ...]
    wire_bytes: tuple[float, ...]


def _run(attention: Any, inputs: Sequence[torch.Tensor], upstream: torch.Tensor, repeats: int
         ) -> tuple[int, float, int, float]:
    """``(saved bytes, median seconds, tiles, bytes sent)`` of ``attention(*inputs)`` forward and backward."""
    times, saved_bytes, tiles, sent = [], 0, 0, 0.0
    for i in range(repeats):
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
        work = TileWork()
        start = time.perf_counter()
        with SavedTensors(exclude=leaves) as saved, count_collectives() as counter:
            out = attention(*leaves, work)
            out.backward(upstream)
        times.append(time.perf_counter() - start)
        if i == 0:
            saved_bytes, tiles, sent = saved.nbytes, work.tiles, counter.wire_bytes()
    return saved_bytes, statistics.median(times), tiles, sent


def _inputs(shape: Shape, seq_len: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seq_len)
    return [torch.randn(shape.batch, shape.heads, seq_len, shape.head_dim, generator=gen) for _ in range(4)]


def measure_one_process(seq_lens: Sequence[int], shape: Shape = Shape()) -> list[Measured]:
    """Full and tiled attention in this process, on one thread as each rank runs, at each length."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # more threads than free cores make the small tiles spin, not compute
    try:
        return _one_process(seq_lens, shape)
    finally:
        torch.set_num_threads(threads)


def _one_process(seq_lens: Sequence[int], shape: Shape) -> list[Measured]:
    found = []
    for s in seq_lens:
        q, k, v, upstream = _inputs(shape, positive_int("seq_len", s))
        runs = {"full": lambda q, k, v, work: full_attention(q, k, v, causal=True),
                "tiled": lambda q, k, v, work: tiled_attention(q, k, v, causal=True, block=shape.block, work=work)}
        for method, attention in runs.items():
            saved, seconds, tiles, sent = _run(attention, (q, k, v), upstream, shape.repeats)
            if method == "full":
                tiles = s * (s + 1) // 2  # every allowed entry, in one tile
            found.append(Measured(method, "-", 1, s, (saved,), (seconds,), (tiles,), (sent,)))
    return found


def measure_on_ranks(rank: int, world_size: int, seq_lens: Sequence[int], shape: Shape,
                     timeout: float = 120.0) -> list[dict]:
    """A ``launch`` worker: ring (both layouts) and Ulysses at each length on ``Mesh(cp=world_size)``.

    Returns this rank's ``(saved bytes, seconds, tiles, bytes sent)`` per run, as dicts with
    ``method``, ``layout`` and ``seq_len``.
    """
    found = []
    with Mesh(cp=world_size).build(timeout=timeout) as pm:
        group, index = pm.group("cp"), pm.index("cp")
        for s in seq_lens:
            whole = _inputs(shape, s)
            for method, layout in RANK_RUNS:
                if method == "ulysses" and shape.heads % world_size:
                    continue
                q, k, v, upstream = (shard_sequence(t, world_size, index, layout, dim=2) for t in whole)
                attention = ring_attention if method == "ring" else ulysses_attention

                def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, work: TileWork) -> torch.Tensor:
                    return attention(q, k, v, group, causal=True, layout=layout, block=shape.block,
                                     timeout=timeout, work=work)

                torch.distributed.barrier(group=group)   # start together: the times compare ranks
                saved, seconds, tiles, sent = _run(run, (q, k, v), upstream, shape.repeats)
                found.append(dict(method=method, layout=layout, seq_len=s, saved_bytes=saved, seconds=seconds,
                                  tiles=tiles, wire_bytes=sent))
    return found


def measure_context(seq_lens: Sequence[int], cps: Sequence[int] = (2, 4), shape: Shape = Shape(),
                    timeout: float = 600.0) -> list[dict]:
    """Every method at every length: full and tiled here, ring and Ulysses on each cp (one launch per cp).

    Returns:
        One dict per method, layout, cp and length (:class:`Measured`'s fields), rows of a table.

    Raises:
        ValueError: a length or cp that is not a positive int, or a length not divisible by 2·cp.
    """
    for cp in cps:
        positive_int("cp", cp)
        for s in seq_lens:
            if positive_int("seq_len", s) % (2 * cp):
                raise ValueError(f"every seq_len must be divisible by 2·cp = {2 * cp}, got seq_len={s}")
    rows = [asdict(m) for m in measure_one_process(seq_lens, shape)]
    for cp in cps:
        per_rank = launch(measure_on_ranks, cp, list(seq_lens), shape, timeout, backend="gloo", timeout=timeout,
                          threads_per_rank=1)
        for i, first in enumerate(per_rank[0]):
            runs = [ranks[i] for ranks in per_rank]
            rows.append(asdict(Measured(first["method"], first["layout"], cp, first["seq_len"],
                                        *(tuple(r[key] for r in runs)
                                          for key in ("saved_bytes", "seconds", "tiles", "wire_bytes")))))
    return rows
