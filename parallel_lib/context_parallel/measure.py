"""Measuring context parallelism: memory kept for backward and time per step, against sequence length.

What the chapter plots and ``python -m parallel_lib.bench context`` prints. For each sequence
length it runs one attention forward and backward (q, k, v of ``batch × heads × s × head_dim``,
causal, fp32) and records, per rank:

- ``saved_bytes``: what autograd keeps for backward beyond q, k, v (the census,
  :class:`~parallel_lib.common.saved_tensors.SavedTensors`), beside :func:`.cost.attention_saved_bytes`;
- ``seconds``: the median wall time of forward plus backward;
- ``tiles`` and ``entries``: the attention tiles, and the score entries in them, computed
  forward (:class:`.tiled.TileWork`): the work; ``compute_seconds``: the time of those tiles alone
  (forward, no waiting for neighbours), the work timed;
- ``wire_bytes``: bytes sent, forward and backward (the collective counter), beside :func:`.cost.cp_wire_bytes`.

And, for when a ring step hides its transfer (:func:`.cost.hiding_seq_len`), one forward ring
step taken apart (:func:`measure_ring_steps`): the attention of a rank's queries on one whole
key/value block, and the exchange of one K and one V block with the neighbours, timed separately
at each length; :func:`measured_hiding_seq_len` reads off the first length whose compute took
at least as long as its transfer. The compute rate and the link's α and β fitted to the same
timings give the prediction to set beside it (``python -m parallel_lib.bench context``).

"full" and "tiled" run in this process; "ring" (contiguous and zig-zag) and "ulysses" run on
``cp`` gloo ranks, one launch per cp holding every length. On a shared CPU the times are noisy
and the transfers are memory copies: the memory and the work are the lesson. Every ring step
waits for the slowest rank, so the ranks' times come out alike: the imbalance of the contiguous
split shows in its total time against zig-zag's, in the tiles, and in each rank's compute time.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch

from parallel_lib.common.saved_tensors import SavedTensors
from parallel_lib.common.checks import positive_int
from parallel_lib.context_parallel.layout import shard_sequence
from parallel_lib.context_parallel.ring import _Ring, ring_attention
from parallel_lib.context_parallel.tiled import TileWork, full_attention, tiled_attention, tiled_forward
from parallel_lib.context_parallel.ulysses import ulysses_attention
from parallel_lib.runtime.collectives import count_collectives
from parallel_lib.runtime.device import rank_device
from parallel_lib.runtime.launcher import launch
from parallel_lib.runtime.mesh import Mesh

__all__ = ["Shape", "Measured", "measure_one_process", "measure_on_ranks", "measure_context", "rank_rows",
           "RingStepMeasured", "measure_ring_steps", "measured_hiding_seq_len"]

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
    entries: tuple[int, ...] = ()    # score entries computed forward (the tiles' areas): the work, finer than tiles
    compute_seconds: tuple[float, ...] = ()   # forward tile loops' time (TileWork.seconds): the work, timed, no waits


def _run(attention: Any, inputs: Sequence[torch.Tensor], upstream: torch.Tensor, repeats: int
         ) -> tuple[int, float, int, float, int, float]:
    """``(saved bytes, median seconds, tiles, bytes sent, entries, median forward compute seconds)`` of
    ``attention(*inputs)`` forward and backward."""
    times, computing, saved_bytes, tiles, sent, entries = [], [], 0, 0, 0.0, 0
    for i in range(repeats):
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
        work = TileWork()
        start = time.perf_counter()
        with SavedTensors(exclude=leaves) as saved, count_collectives() as counter:
            out = attention(*leaves, work)
            out.backward(upstream)
        times.append(time.perf_counter() - start)
        computing.append(work.seconds)
        if i == 0:
            saved_bytes, tiles, sent, entries = saved.nbytes, work.tiles, counter.wire_bytes(), work.entries
    return saved_bytes, statistics.median(times), tiles, sent, entries, statistics.median(computing)


def _inputs(shape: Shape, seq_len: int, device: torch.device = torch.device("cpu")) -> list[torch.Tensor]:
    """q, k, v and an output gradient of the whole sequence, the same on every rank (drawn on the CPU)."""
    gen = torch.Generator().manual_seed(seq_len)
    return [torch.randn(shape.batch, shape.heads, seq_len, shape.head_dim, generator=gen).to(device)
            for _ in range(4)]


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
            saved, seconds, tiles, sent, entries, computing = _run(attention, (q, k, v), upstream, shape.repeats)
            if method == "full":
                tiles = s * (s + 1) // 2  # every allowed entry, in one tile
                entries = s * s           # the whole score matrix is computed, the masked entries too
            found.append(Measured(method, "-", 1, s, (saved,), (seconds,), (tiles,), (sent,), (entries,),
                                  (computing,)))
    return found


def measure_on_ranks(rank: int, world_size: int, seq_lens: Sequence[int], shape: Shape,
                     timeout: float = 120.0) -> list[dict]:
    """A ``launch`` worker: ring (both layouts) and Ulysses at each length on ``Mesh(cp=world_size)``.

    Returns this rank's ``(saved bytes, seconds, tiles, bytes sent, entries)`` per run, as dicts with
    ``method``, ``layout`` and ``seq_len``.
    """
    found = []
    with Mesh(cp=world_size).build(timeout=timeout) as pm:
        group, index = pm.group("cp"), pm.index("cp")
        for s in seq_lens:
            whole = _inputs(shape, s, rank_device())
            for method, layout in RANK_RUNS:
                if method == "ulysses" and shape.heads % world_size:
                    continue
                q, k, v, upstream = (shard_sequence(t, world_size, index, layout, dim=2) for t in whole)
                attention = ring_attention if method == "ring" else ulysses_attention

                def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, work: TileWork) -> torch.Tensor:
                    return attention(q, k, v, group, causal=True, layout=layout, block=shape.block,
                                     timeout=timeout, work=work)

                torch.distributed.barrier(group=group)   # start together: the times compare ranks
                saved, seconds, tiles, sent, entries, computing = _run(run, (q, k, v), upstream, shape.repeats)
                found.append(dict(method=method, layout=layout, seq_len=s, saved_bytes=saved, seconds=seconds,
                                  tiles=tiles, wire_bytes=sent, entries=entries, compute_seconds=computing))
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
        rows += rank_rows(per_rank, cp)
    return rows


def rank_rows(per_rank: Sequence[Sequence[dict]], cp: int) -> list[dict]:
    """:func:`measure_on_ranks`'s answers from every rank (in rank order) as rows, one per run, each with
    per-rank tuples (:class:`Measured`'s fields)."""
    rows = []
    for i, first in enumerate(per_rank[0]):
        runs = [ranks[i] for ranks in per_rank]
        rows.append(asdict(Measured(first["method"], first["layout"], cp, first["seq_len"],
                                    *(tuple(r[key] for r in runs)
                                      for key in ("saved_bytes", "seconds", "tiles", "wire_bytes", "entries",
                                                  "compute_seconds")))))
    return rows


@dataclass(frozen=True)
class RingStepMeasured:
    """One forward ring step at one length, on the slowest rank: its compute and its transfer, timed apart."""

    seq_len: int
    compute_s: float      # attention of the rank's s/cp queries on one whole key/value block (tiles)
    transfer_s: float     # one batch_isend_irecv of one K and one V block with the neighbours
    block_bytes: int      # bytes of that message (one K and one V block)


def _median_seconds(fn: Any, repeats: int, group: Any, device: torch.device) -> float:
    """Median wall time of ``fn()`` over ``repeats`` (after a warm-up), the ranks started together; the slowest
    rank's median (a step lasts until its slowest rank is done)."""
    fn()
    times = []
    for _ in range(repeats):
        torch.distributed.barrier(group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    median = torch.tensor(statistics.median(times), dtype=torch.float64, device=device)
    torch.distributed.all_reduce(median, op=torch.distributed.ReduceOp.MAX, group=group)
    return float(median)


def measure_ring_steps(rank: int, world_size: int, seq_lens: Sequence[int], shape: Shape = Shape(),
                       timeout: float = 120.0) -> list[RingStepMeasured]:
    """A ``launch`` worker: one ring step's compute and its transfer, timed separately, at each length.

    The compute is :func:`.tiled.tiled_forward` of this rank's s/cp queries on a whole block of
    s/cp keys (no mask: the work :func:`.cost.ring_step_flops` counts); the transfer is the
    ring's own exchange (``batch_isend_irecv`` of the stacked K and V block to the right-hand
    neighbour, the next from the left), waited for. Both are the median of ``shape.repeats``
    after a warm-up, the slowest rank's.

    Returns:
        One :class:`RingStepMeasured` per length, the same on every rank.

    Raises:
        ValueError: a length that is not a positive int divisible by ``2·world_size``.
    """
    found = []
    device = rank_device()
    with Mesh(cp=world_size).build(timeout=timeout) as pm:
        group = pm.group("cp")
        for s in seq_lens:
            if positive_int("seq_len", s) % (2 * world_size):
                raise ValueError(f"every seq_len must be divisible by 2·cp = {2 * world_size}, got seq_len={s}")
            local = s // world_size
            q, k, v, _ = (t[:, :, :local] for t in _inputs(shape, s, device))
            kv = torch.stack([k, v]).contiguous()
            ring = _Ring(group, "contiguous", local, timeout, device)
            compute = _median_seconds(lambda: tiled_forward(q, k, v, block=shape.block), shape.repeats, group, device)
            transfer = _median_seconds(lambda: ring.finish(ring.post([kv]), "a timed key/value exchange"),
                                       shape.repeats, group, device)
            found.append(RingStepMeasured(s, compute, transfer, kv.numel() * kv.element_size()))
    return found


def measured_hiding_seq_len(steps: Sequence[RingStepMeasured]) -> int | None:
    """The first measured length from which on every step's compute took at least its transfer (None: none did).

    "From which on": a length where compute overtook the transfer by noise, followed by one
    where it did not, does not count.
    """
    ordered = sorted(steps, key=lambda m: m.seq_len)
    found = None
    for m in ordered:
        if m.compute_s >= m.transfer_s:
            found = m.seq_len if found is None else found
        else:
            found = None
    return found
