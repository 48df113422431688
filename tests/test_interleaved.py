"""A collective's cost as a step pays it (``planner.interleaved``): the calibration's α holds the waits.

The ranks here are threads of a simulated world whose clocks are known exactly: a piece of compute
moves its rank's clock on, a collective ends on every rank at the last arrival plus its α–β time,
and a rank that arrived before the last pays a wake-up wait on top (it slept and must be scheduled
again). Timed back to back, as the calibration did before issue #21 item 8, such a collective costs
only its α–β time; inside a step each call also pays the wake-up and the wait for the rank whose
piece was slower. The fit must recover both, from first principles worked out below.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from parallel_lib.cost.alpha_beta import AlphaBeta, hops
from parallel_lib.planner.calibrate import SIZES
from parallel_lib.planner.interleaved import (JITTER, PIECE_ROWS, World, compute_pieces, fit_interleaved,
                                              interleaved_seconds)

LINK = AlphaBeta(200e-6, 2e9)    # the collective's own cost, as back-to-back calls show it
PIECE, SLOWER = 1e-3, 0.4e-3     # every rank's piece of compute; the round's slow rank takes SLOWER more


class SimulatedWorld:
    """``n`` ranks (threads) with exact clocks; every rank must call the same meetings in the same order."""

    def __init__(self, n: int, wake: float) -> None:
        self.n, self.wake = n, wake
        self.clocks = [0.0] * n
        self.posted: list = [None] * n
        self.meeting = threading.Barrier(n, timeout=20)

    def _exchange(self, rank: int, value):  # every rank's value, once all have posted theirs
        self.posted[rank] = value
        self.meeting.wait()
        values = list(self.posted)
        self.meeting.wait()  # nobody posts the next value before every rank has read this one
        return values

    def world(self, rank: int) -> World:
        def barrier() -> None:
            self.clocks[rank] = max(self._exchange(rank, self.clocks[rank]))

        def slowest(values):
            return [max(column) for column in zip(*self._exchange(rank, list(values)))]

        return World(lambda: self.clocks[rank], barrier, slowest, lambda: None)

    def collective(self, rank: int, seconds: float):
        def call() -> None:
            last = max(self._exchange(rank, self.clocks[rank]))
            waited = self.clocks[rank] < last
            self.clocks[rank] = last + seconds + (self.wake if waited else 0.0)
        return call

    def pieces(self, rank: int, rounds: int, slower: float):
        """Round k's slow rank is k mod n (never the same one twice running): the others wait for it."""
        def piece(seconds: float):
            def run() -> None:
                self.clocks[rank] += seconds
            return run
        return [piece(PIECE + (slower if k % self.n == rank else 0.0)) for k in range(rounds)]


def _fit_on_every_rank(kind: str, n: int, wake: float, slower: float) -> list[AlphaBeta]:
    sim = SimulatedWorld(n, wake)

    def rank_fit(rank: int) -> AlphaBeta:
        return fit_interleaved(kind, n, SIZES, lambda nbytes: sim.collective(rank, LINK.seconds(kind, nbytes, n)),
                               sim.pieces(rank, 4 * n, slower), 3, sim.world(rank))

    with ThreadPoolExecutor(n) as pool:
        return [f.result(timeout=60) for f in [pool.submit(rank_fit, r) for r in range(n)]]


@pytest.mark.parametrize("kind", ["all_reduce", "send", "all_gather"])
@pytest.mark.parametrize("n", [2, 4])
def test_the_fitted_alpha_holds_the_wake_up_and_the_wait_for_the_slowest_rank(kind, n):
    wake = 0.7e-3
    # per round: the slow rank arrives SLOWER after the others, which wait and pay the wake-up; the next
    # round's slow rank is one of them, so a step with the collectives lasts rounds x (PIECE + SLOWER +
    # its cost + wake). Without them each rank computes rounds x PIECE + rounds / n x SLOWER. The
    # difference per call: the collective's cost + wake + SLOWER (n - 1) / n, a cost per call: in α.
    expected = AlphaBeta(LINK.alpha + (wake + SLOWER * (n - 1) / n) / hops(kind, n), LINK.bandwidth)
    for fit in _fit_on_every_rank(kind, n, wake, SLOWER):
        assert fit.alpha == pytest.approx(expected.alpha, rel=1e-6)
        assert fit.bandwidth == pytest.approx(expected.bandwidth, rel=1e-6)
        assert fit.alpha > LINK.alpha  # what a fit to back-to-back calls misses


def test_without_waits_the_procedure_adds_nothing_of_its_own():
    # equal pieces and no wake-up: the collective costs a step what it costs back to back
    for fit in _fit_on_every_rank("all_reduce", 2, wake=0.0, slower=0.0):
        assert fit.alpha == pytest.approx(LINK.alpha, rel=1e-6)
        assert fit.bandwidth == pytest.approx(LINK.bandwidth, rel=1e-6)


def test_pieces_are_the_same_draw_on_every_rank_varied_a_little_per_rank():
    rows = [[piece().shape[0] for piece in compute_pieces(rank, rounds=8, seed=3)] for rank in range(2)]
    assert all(PIECE_ROWS[0] * (1 - JITTER) <= r <= PIECE_ROWS[1] * (1 + JITTER) + 1 for r in rows[0] + rows[1])
    ratios = [a / b for a, b in zip(*rows)]
    assert all((1 - JITTER) / (1 + JITTER) - 0.01 <= q <= (1 + JITTER) / (1 - JITTER) + 0.01 for q in ratios)
    assert any(a != b for a, b in zip(*rows))  # the ranks' pieces differ: a real step's do
    assert len(set(rows[0])) > 1  # and the rounds differ
    same = [piece().shape[0] for piece in compute_pieces(0, rounds=8, seed=3, jitter=0.0)]
    assert same == [piece().shape[0] for piece in compute_pieces(1, rounds=8, seed=3, jitter=0.0)]
    assert compute_pieces(0, rounds=1, width=16)[0]().dtype == torch.float32


@pytest.mark.parametrize("kwargs, match", [
    (dict(rounds=0), "rounds must be an int >= 1"),
    (dict(rows=(10, 5)), r"rows must be \(low, high\) with 1 <= low <= high, got rows=\(10, 5\)"),
    (dict(jitter=1.0), r"jitter must be in \[0, 1\), got jitter=1.0"),
])
def test_bad_pieces_are_refused_with_the_argument_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        compute_pieces(0, **kwargs)


def test_the_procedure_refuses_no_repeats_and_no_pieces():
    world = SimulatedWorld(1, 0.0)
    with pytest.raises(ValueError, match="repeats must be an int >= 1"):
        interleaved_seconds(world.collective(0, 1e-3), world.pieces(0, 2, 0.0), 0, world.world(0))
    with pytest.raises(ValueError, match="pieces is empty"):
        interleaved_seconds(world.collective(0, 1e-3), [], 2, world.world(0))
