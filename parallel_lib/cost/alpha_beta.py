"""The time of one collective: the α–β model, ``hops·α + wire_bytes/β``, and its fit to measured times.

A ring collective over ``n`` ranks runs in steps ("hops"); each step pays a latency α, and each
rank sends its share of the message at a bandwidth β. What one rank sends (the wire bytes) and
how many hops it takes depend on the collective:

============== ================ =========
collective     wire bytes       hops
============== ================ =========
all-reduce     2(n−1)/n · S     2(n−1)
reduce-scatter (n−1)/n · S      n−1
all-gather     (n−1)/n · S      n−1
all-to-all     (n−1)/n · S      —
send/recv      S                1
============== ================ =========

(Patarasuk and Yuan 2009 for the ring all-reduce; nccl-tests' PERFORMANCE.md for the same factors
as "bus bandwidth".) Chapter 02 fits this model to a measured all-reduce, the planner fits it to
each collective on this machine (:mod:`parallel_lib.planner.calibrate`), and chapter 11 to the
ring's send/recv: one model, one fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from parallel_lib.common.checks import check_choice, check_int, check_number, positive_int

__all__ = ["KINDS", "ring_wire_bytes", "wire_bytes", "hops", "AlphaBeta", "fit_alpha_beta", "allreduce_cost",
           "fit_allreduce_cost"]

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "send")  # the collectives the model prices


def ring_wire_bytes(kind: str, nbytes: float, group_size: int) -> float:
    """Bytes one rank sends for a collective of ``nbytes`` over ``group_size`` ranks (ring algorithm).

    For a broadcast this is the source's share; the counter records 0 on the other ranks.
    """
    n = group_size
    if kind == "all_reduce":
        return 2 * (n - 1) / n * nbytes
    if kind in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n * nbytes
    if kind in ("send", "broadcast"):
        return float(nbytes)
    return 0.0


def wire_bytes(collectives: Mapping[str, tuple[int, float]], group_size: int) -> float:
    """Bytes one rank sends for a group's collectives, ``{kind: (calls, message bytes)}``, under the ring algorithm."""
    return sum(ring_wire_bytes(kind, nbytes, group_size) for kind, (_, nbytes) in collectives.items())


def hops(kind: str, group_size: int) -> int:
    """Ring steps of a collective over ``group_size`` ranks: each costs one latency α."""
    n = positive_int("group_size", group_size)
    check_choice("kind", kind, KINDS)
    return {"all_reduce": 2 * (n - 1), "reduce_scatter": n - 1, "all_gather": n - 1, "send": 1}[kind]


@dataclass(frozen=True)
class AlphaBeta:
    """One link's cost model: ``hops·alpha + wire_bytes/bandwidth`` seconds per collective."""

    alpha: float          # seconds per ring step (latency)
    bandwidth: float      # bytes per second one rank sends

    def seconds(self, kind: str, nbytes: float, group_size: int) -> float:
        """Time of one ``kind`` collective of ``nbytes`` (the message, as the counter records it)."""
        if group_size < 2 or nbytes <= 0:
            return 0.0
        return hops(kind, group_size) * self.alpha + ring_wire_bytes(kind, nbytes, group_size) / self.bandwidth


def fit_alpha_beta(kind: str, group_size: int, nbytes: Sequence[float], seconds: Sequence[float],
                   fallback: bool = True) -> AlphaBeta:
    """Least-squares α and β of ``t = hops·α + wire/β`` for one collective, weighting relative errors.

    Each point is weighted by 1/t, so small messages (where α shows) count as much as large ones.

    Args:
        kind: the collective (one of :data:`KINDS`).
        group_size: ranks it ran over.
        nbytes: message sizes, at least two distinct.
        seconds: the time measured for each.
        fallback: when the times do not grow with size (a loaded machine), take β from the two
            extreme sizes and α from the smallest instead of raising.

    Raises:
        ValueError: fewer than two distinct sizes, or (without ``fallback``) times that do not grow with size.
    """
    if len(nbytes) != len(seconds) or len(set(nbytes)) < 2:
        raise ValueError(f"need matching sizes and times with >= 2 distinct sizes, got {len(nbytes)} sizes "
                         f"({len(set(nbytes))} distinct) and {len(seconds)} times")
    # host arithmetic, whatever the default device
    wire = torch.tensor([ring_wire_bytes(kind, s, group_size) for s in nbytes], dtype=torch.float64, device="cpu")
    y = torch.tensor(list(seconds), dtype=torch.float64, device="cpu")
    design = torch.stack([wire, torch.full_like(wire, float(hops(kind, group_size)))], dim=1)
    slope, alpha = torch.linalg.lstsq(design / y[:, None], torch.ones_like(y)[:, None]).solution[:, 0].tolist()
    if slope <= 1e-13:  # no growth, or faster than 10 TB/s
        if not fallback:
            raise ValueError(f"times do not grow with size (slope {slope:.3g} s/byte); measure larger messages")
        rise = (y[-1] - y[0]).item()
        slope = rise / (wire[-1] - wire[0]).item() if rise > 0 else y[-1].item() / wire[-1].item()
        alpha = y[0].item() / hops(kind, group_size)
    return AlphaBeta(max(alpha, 0.0), 1.0 / slope)


def allreduce_cost(nbytes: float, world_size: int, bandwidth: float, latency: float) -> float:
    """Seconds a ring all-reduce of ``nbytes`` takes: ``2(N-1)/N * S/B + 2(N-1) * alpha``.

    Each of the 2(N-1) steps pays the per-message latency and moves S/N bytes per link.

    Args:
        nbytes: message size S in bytes.
        world_size: number of ranks N.
        bandwidth: link bandwidth B in bytes per second.
        latency: per-message latency alpha in seconds.

    Raises:
        ValueError: a size or latency below 0, a bandwidth not above 0 (NaN and inf too), ``world_size < 1``.
    """
    check_number("nbytes", nbytes, 0.0)  # NaN too: a NaN cost would rank as no cost at all
    check_int("world_size", world_size, minimum=1)
    check_number("bandwidth", bandwidth, 0.0, strict=True, hint="bytes per second")
    check_number("latency", latency, 0.0, hint="seconds per message")
    return AlphaBeta(latency, bandwidth).seconds("all_reduce", nbytes, world_size)


def fit_allreduce_cost(nbytes: Sequence[float], seconds: Sequence[float], world_size: int) -> tuple[float, float]:
    """Least-squares ``(bandwidth, latency)`` of :func:`allreduce_cost` for measured times.

    Raises:
        ValueError: fewer than two distinct sizes, ``world_size < 2``, or times that do not grow with size.
    """
    check_int("world_size", world_size, minimum=2)
    fit = fit_alpha_beta("all_reduce", world_size, nbytes, seconds, fallback=False)
    return fit.bandwidth, fit.alpha
