"""The ring all-reduce's cost model: the alpha-beta model, nccl-tests' bandwidths, and a fit.

Split from :mod:`parallel_lib.data_parallel.ring` (the algorithm) so that each file holds one
idea; both names stay importable from there and from :mod:`parallel_lib.data_parallel`.
"""

from __future__ import annotations

from typing import Sequence

import torch

from parallel_lib.common.checks import check_int, check_number

__all__ = ["allreduce_cost", "algorithm_bandwidth", "bus_bandwidth", "fit_allreduce_cost"]


def _check_cost_args(nbytes: float, world_size: int) -> None:
    check_number("nbytes", nbytes, 0.0)  # NaN too: a NaN cost would rank as no cost at all
    check_int("world_size", world_size, minimum=1)


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
    _check_cost_args(nbytes, world_size)
    check_number("bandwidth", bandwidth, 0.0, strict=True, hint="bytes per second")
    check_number("latency", latency, 0.0, hint="seconds per message")
    n = world_size
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


def algorithm_bandwidth(nbytes: float, seconds: float) -> float:
    """nccl-tests' "algbw": message size over time, in bytes per second."""
    check_number("seconds", seconds, 0.0, strict=True)
    return nbytes / seconds


def bus_bandwidth(algbw: float, world_size: int) -> float:
    """nccl-tests' "busbw" of an all-reduce: ``algbw * 2(N-1)/N``.

    The factor is the share of the message each link carries in a ring, so busbw
    can be compared with the hardware's link bandwidth whatever the number of ranks.
    """
    _check_cost_args(algbw, world_size)
    return algbw * 2 * (world_size - 1) / world_size


def fit_allreduce_cost(nbytes: Sequence[float], seconds: Sequence[float], world_size: int) -> tuple[float, float]:
    """Least-squares ``(bandwidth, latency)`` of :func:`allreduce_cost` for measured times.

    The model is linear in S, ``t = a * S + b``, so ``B = 2(N-1)/N / a`` and ``alpha = b / 2(N-1)``.

    Raises:
        ValueError: fewer than two distinct sizes, ``world_size < 2``, or a fit with no positive slope.
    """
    check_int("world_size", world_size, minimum=2)
    if len(nbytes) != len(seconds) or len(set(nbytes)) < 2:
        raise ValueError(f"need matching sizes and times with >= 2 distinct sizes, got {len(nbytes)} sizes "
                         f"({len(set(nbytes))} distinct) and {len(seconds)} times")
    x = torch.tensor(nbytes, dtype=torch.float64)
    y = torch.tensor(seconds, dtype=torch.float64)
    design = torch.stack([x, torch.ones_like(x)], dim=1)  # (n_points, 2)
    # weight each point by 1/t: relative errors, so small messages count as much as large ones
    slope, intercept = torch.linalg.lstsq(design / y[:, None], torch.ones_like(y)[:, None]).solution[:, 0].tolist()
    if slope <= 0:
        raise ValueError(f"times do not grow with size (slope {slope:.3g} s/byte); measure larger messages")
    n = world_size
    return 2 * (n - 1) / n / slope, max(intercept, 0.0) / (2 * (n - 1))
