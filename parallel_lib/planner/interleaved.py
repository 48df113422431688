"""What one collective costs a step: timed between pieces of compute, as a step runs it, not back to back.

A collective started by every rank at the same moment, over and over, costs its ring steps and its
bytes: the α–β model's ``hops·α + wire/β``. Inside a training step it costs more. Each rank reaches
it after its own piece of compute (a block's forward, a layer group's gather), and the pieces never
take exactly the same time on every rank: the ranks that arrive first wait for the last one, and on
a shared CPU a rank that waited must be scheduled again before it goes on. Those waits are paid once
per call, so a layout made of many small collectives between short computations (tensor
parallelism, ZeRO-3, recomputation) pays them many times; a fit to collectives run back to back never
sees them, and the planner under-predicts exactly those layouts (issue #21, item 8; chapter 09's
profile found 1.9 ms per decode all-reduce inside generation against 0.3–0.4 ms back to back).

So the calibration times each collective the way a step runs it (:func:`interleaved_seconds`):

1. every rank gets :data:`ROUNDS` pieces of compute (:func:`compute_pieces`): a matrix product whose
   rows are drawn per round, the same draw on every rank, then varied by up to ±:data:`JITTER` per
   rank and round, as a block's compute varies between ranks in a real step;
2. from a common start (a barrier), each rank runs its pieces with the collective after each one,
   and again the same pieces without it; each phase lasts until its slowest rank is done;
3. the collective's cost is the difference over the number of pieces, the median over repeats
   (never less than the same collective timed alone: noise can make the difference smaller).

The costs at a few message sizes feed the course's one α–β fit
(:func:`parallel_lib.cost.alpha_beta.fit_alpha_beta`, :func:`fit_interleaved`): α then holds the
waits a call pays, β the bytes. How the ranks meet outside the timed work (the clock, the barrier,
the maximum over ranks) is a :class:`World`: :func:`dist_world` for real ranks, a simulated one in
the tests, where the waits are known and the fit must recover them.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from parallel_lib.common.checks import positive_int
from parallel_lib.cost.alpha_beta import AlphaBeta, fit_alpha_beta

__all__ = ["ROUNDS", "JITTER", "PIECE_ROWS", "PIECE_WIDTH", "World", "dist_world", "compute_pieces",
           "interleaved_seconds", "fit_interleaved"]

ROUNDS = 8                 # pieces of compute, each followed by one collective, per timed phase
JITTER = 0.1               # each rank's piece differs from the round's by up to ±10 %
PIECE_ROWS = (256, 1024)   # rows of a piece's (rows × 256) @ (256 × 256) product: 0.2–0.9 ms on one core here,
PIECE_WIDTH = 256          # about the compute between two of a tiny GPT-2 step's tensor-parallel all-reduces

Action = Callable[[], object]


@dataclass(frozen=True)
class World:
    """How one rank meets the others outside the timed work."""

    clock: Callable[[], float]                          # seconds, this rank's
    barrier: Callable[[], None]                         # every rank here (and its device idle) before any goes on
    slowest: Callable[[Sequence[float]], list[float]]   # element-wise maximum over the ranks
    settle: Callable[[], None]                          # wait for this rank's queued device work (a GPU's)


def dist_world(device: torch.device) -> World:
    """The :class:`World` of ``torch.distributed``'s default group, its numbers on ``device`` (NCCL: the GPU)."""
    def settle() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def barrier() -> None:
        settle()
        dist.barrier()

    def slowest(values: Sequence[float]) -> list[float]:
        t = torch.tensor(list(values), dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [float(v) for v in t.tolist()]

    return World(time.perf_counter, barrier, slowest, settle)


def compute_pieces(rank: int, rounds: int = ROUNDS, device: torch.device = torch.device("cpu"), seed: int = 0,
                   rows: tuple[int, int] = PIECE_ROWS, jitter: float = JITTER,
                   width: int = PIECE_WIDTH) -> list[Action]:
    """``rounds`` pieces of compute for ``rank``: ``(r × width) @ (width × width)`` products on ``device``.

    Round k's rows are drawn from ``rows`` with ``seed`` (the same on every rank), then scaled by a
    factor in ``[1 − jitter, 1 + jitter]`` drawn for this rank and round.

    Raises:
        ValueError: ``rounds`` or ``width`` not an int >= 1, ``rows`` not ``(low, high)`` with
            ``1 <= low <= high``, or ``jitter`` outside ``[0, 1)``.
    """
    positive_int("rounds", rounds)
    positive_int("width", width)
    if not (len(rows) == 2 and 1 <= rows[0] <= rows[1]):
        raise ValueError(f"rows must be (low, high) with 1 <= low <= high, got rows={rows!r}")
    if not 0 <= jitter < 1:
        raise ValueError(f"jitter must be in [0, 1), got jitter={jitter!r}")
    shared, own = random.Random(seed), random.Random(seed * 1_000_003 + rank + 1)
    weight = torch.rand(width, width, device=device)
    pieces = []
    for _ in range(rounds):
        r = max(1, round(shared.randint(*rows) * (1 + jitter * own.uniform(-1, 1))))
        x = torch.rand(r, width, device=device)
        pieces.append(lambda x=x: torch.mm(x, weight))
    return pieces


def _phase(pieces: Sequence[Action], collective: Action | None, world: World) -> float:
    """Seconds this rank takes from a common start to run ``pieces``, each followed by ``collective``."""
    world.barrier()
    start = world.clock()
    for piece in pieces:
        piece()
        if collective is not None:
            collective()
    world.settle()
    return world.clock() - start


def interleaved_seconds(collective: Action, pieces: Sequence[Action], repeats: int, world: World) -> float:
    """Seconds one call of ``collective`` adds to a step that runs it after each of ``pieces``.

    Every rank of ``world`` calls this at once, with its own ``pieces`` (as many on every rank).
    Per repeat (after one warm-up): the pieces with the collective after each, the same pieces
    without it, and the collective alone, each from a common start and lasting until its slowest
    rank is done. Returns the median over repeats of (with − without) / pieces, or of the
    collective alone if that is larger.

    Raises:
        ValueError: ``repeats`` not an int >= 1, or no pieces.
    """
    positive_int("repeats", repeats)
    if not pieces:
        raise ValueError("pieces is empty: give at least one piece of compute to run between the collectives")
    added, alone = [], []
    for k in range(repeats + 1):  # the first is a warm-up: buffers, connections, caches
        both, bare = _phase(pieces, collective, world), _phase(pieces, None, world)
        single = _phase([collective], None, world)  # the collective alone, every rank starting it together
        both, bare, single = world.slowest([both, bare, single])
        if k:
            added.append((both - bare) / len(pieces))
            alone.append(single)
    return max(statistics.median(added), statistics.median(alone))


def fit_interleaved(kind: str, group_size: int, sizes: Sequence[int], collective_of: Callable[[int], Action],
                    pieces: Sequence[Action], repeats: int, world: World) -> AlphaBeta:
    """The α–β of ``kind`` fitted to what it costs between pieces of compute at each message size.

    Args:
        kind: the collective (one of :data:`parallel_lib.cost.alpha_beta.KINDS`).
        group_size: the ranks of ``world`` it runs over.
        sizes: message sizes in bytes (as the collective counter records them), at least two distinct.
        collective_of: a size in bytes -> one call of the collective with a message that size.
        pieces: this rank's pieces of compute (:func:`compute_pieces`).
        repeats: timed repeats per size (:func:`interleaved_seconds`).
        world: how the ranks meet (:func:`dist_world`).

    Raises:
        ValueError: as :func:`interleaved_seconds` and :func:`~parallel_lib.cost.alpha_beta.fit_alpha_beta`.
    """
    seconds = [interleaved_seconds(collective_of(nbytes), pieces, repeats, world) for nbytes in sizes]
    return fit_alpha_beta(kind, group_size, [float(s) for s in sizes], seconds)
