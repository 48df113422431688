"""Chapter 02's GPU check: the course's ring all-reduce against ``dist.all_reduce`` on NCCL.

:func:`check_allreduce` runs ``python -m parallel_lib.bench allreduce`` over the GPUs and fails
when the ring's sums differ from the built-in's. :mod:`parallel_lib.gpu_checks` registers it as
``allreduce``.
"""

from __future__ import annotations

from dataclasses import replace

from parallel_lib.bench import allreduce as bench_allreduce
from parallel_lib.gpu_checks._reference import CheckError

__all__ = ["check_allreduce"]


def check_allreduce(n_gpus: int, quick: bool = False) -> str:
    """The all-reduce benchmark over ``n_gpus`` ranks; the ring must agree with the built-in."""
    results = bench_allreduce.measure(replace(bench_allreduce.QUICK if quick else bench_allreduce.Config(),
                                              world_size=n_gpus))
    if not results.max_error < 1e-3:  # float sums in another order differ by ~1e-6 here
        raise CheckError(f"ring_all_reduce differs from dist.all_reduce by {results.max_error:.3g}")
    return bench_allreduce.markdown(results)
