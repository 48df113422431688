"""Each collective of a block of code, timed where it is called: its kind, its message and when it entered and left.

The collective counter (:mod:`parallel_lib.runtime.collectives`) counts calls and bytes; this times
them. A collective's time inside a step is what a layout pays for it: the wait for the last rank of
its group to arrive, and the transfer after it did. Chapter 07's benchmark splits the two; the
planner's calibration fits its tensor-parallel α–β to these times inside a real step.

Only calls through ``torch.distributed``'s module attributes are seen (the course's
:mod:`~parallel_lib.tensor_parallel.regions` calls them so); DTensor's functional collectives are not.
"""

from __future__ import annotations

import functools
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from parallel_lib.runtime.compat import collective_name

__all__ = ["timed_collectives"]

# the torch.distributed functions the course's split calls (through the module attribute), and their kind
_TIMED = {"all_reduce": "all_reduce", collective_name("all_gather_single"): "all_gather",
          collective_name("reduce_scatter_single"): "reduce_scatter"}


@contextmanager
def timed_collectives() -> Iterator[list[tuple[str, int, float, float]]]:
    """Record ``(kind, message bytes, entry, exit)`` of every all-reduce, all-gather and reduce-scatter in the block.

    Yields the list the calls are appended to. Times are ``time.perf_counter`` (the system-wide
    monotonic clock on Linux, so entries of ranks on one host compare); the functions are put back on exit.
    """
    calls: list[tuple[str, int, float, float]] = []
    originals = {name: getattr(dist, name) for name in _TIMED}

    def timed(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            # the message as the counter records it: the tensor, or the whole (gathered, scattered) one
            tensor = max(args[:2], key=torch.Tensor.numel) if name != "all_reduce" else args[0]
            start = time.perf_counter()
            out = original(*args, **kwargs)
            calls.append((_TIMED[name], tensor.numel() * tensor.element_size(), start, time.perf_counter()))
            return out
        return call

    for name, original in originals.items():
        setattr(dist, name, timed(name, original))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
