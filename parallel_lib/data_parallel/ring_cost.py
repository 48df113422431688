"""The ring all-reduce's measured bandwidths, as nccl-tests reports them (algbw, busbw).

The cost model itself, :func:`allreduce_cost` and its fit :func:`fit_allreduce_cost`, is the course's
one α–β model (:mod:`parallel_lib.cost.alpha_beta`); both stay importable from here, from
:mod:`parallel_lib.data_parallel.ring` and from :mod:`parallel_lib.data_parallel`.
"""

from __future__ import annotations

from parallel_lib.common.checks import check_int, check_number
from parallel_lib.cost.alpha_beta import allreduce_cost, fit_allreduce_cost

__all__ = ["allreduce_cost", "algorithm_bandwidth", "bus_bandwidth", "fit_allreduce_cost"]


def algorithm_bandwidth(nbytes: float, seconds: float) -> float:
    """nccl-tests' "algbw": message size over time, in bytes per second."""
    check_number("seconds", seconds, 0.0, strict=True)
    return nbytes / seconds


def bus_bandwidth(algbw: float, world_size: int) -> float:
    """nccl-tests' "busbw" of an all-reduce: ``algbw * 2(N-1)/N``.

    The factor is the share of the message each link carries in a ring, so busbw
    can be compared with the hardware's link bandwidth whatever the number of ranks.
    """
    check_number("algbw", algbw, 0.0)
    check_int("world_size", world_size, minimum=1)
    return algbw * 2 * (world_size - 1) / world_size
