"""Exercises for chapter 06: ZeRO's bytes per rank, stage 3's traffic predicted before it is measured, a ZeRO-2
step written from reduce-scatter and all-gather (``ch06_zero2``), and clipping by the global norm of a sharded
gradient (``ch06_clip``), both on gloo ranks.

The checkers compare with the library's own answers (``zero_memory``, ``zero_traffic``, one process,
``ZeroEngine.clip_grad_norm_``); the reference answers are in ``solutions.py``. ``check_shard_owner``
(who owns element i of a padded flat buffer) stays a checker without a notebook cell: the ZeRO-2
exercise has the student cut the buffer into its shards.
"""

from __future__ import annotations

import math
from typing import Any

from parallel_lib.exercises._core import (Case, CheckResult, Exercise, as_int, as_number, check_function, same_number,
                                         solution)
from parallel_lib.exercises.ch06_clip import CLIP_STUB, check_clip_grad_norm_sharded
from parallel_lib.exercises.ch06_zero2 import ZERO2_STUB, check_zero2_step
from parallel_lib.sharding.flat import shard_owner
from parallel_lib.sharding.memory import zero_memory, zero_traffic

__all__ = ["check_shard_owner", "check_zero_bytes_per_rank", "check_zero3_bytes_sent", "check_zero2_step",
           "check_clip_grad_norm_sharded", "EXERCISES"]

SHARD_OWNER_STUB = '''\
def owner_of(index, numel, world_size):
    """The rank whose shard holds element `index` of a flat buffer of `numel` real elements, padded
    to a multiple of `world_size` and cut into `world_size` equal contiguous shards."""
    ...  # your code here
'''

BYTES_STUB = '''\
def zero_bytes_per_rank(n_params, world_size, stage):
    """Model-state bytes on each rank under ZeRO `stage` (0-3), mixed-precision Adam: bf16 parameters
    (2 bytes) and gradients (2 bytes), fp32 master weights and two fp32 moments (12 bytes)."""
    ...  # your code here
'''

TRAFFIC_STUB = '''\
def zero3_bytes_sent(n_params, world_size, bytes_per_param):
    """Bytes one rank sends per training step under ZeRO-3 with ring collectives (the parameters are
    all-gathered for the forward and again for the backward; the gradients are reduce-scattered)."""
    ...  # your code here
'''


def _owner_hint(args: tuple, got: Any) -> str:
    index, numel, n = args
    shard = math.ceil(numel / n)
    if got in (index * n // numel, index // max(1, numel // n)):
        return f"the shards are ceil({numel} / {n}) = {shard} elements each, padding included, not numel / N"
    return f"every shard holds ceil(numel / N) = {shard} elements; element i is in shard i // {shard}"


def check_shard_owner(fn: Any) -> CheckResult:
    """Check ``owner_of(index, numel, world_size)`` against ``shard_owner``."""
    args = [(0, 8, 4), (7, 8, 4), (3, 10, 4), (5, 10, 4), (8, 10, 4), (9, 10, 4), (12, 13, 2), (99, 100, 3),
            (67, 100, 3)]
    cases = [Case(a, shard_owner(*a)) for a in args]
    return check_function("shard_owner", fn, "owner_of", cases, normalise=as_int, hint=_owner_hint)


def _bytes_hint(args: tuple, got: Any) -> str:
    n_params, n, stage = args
    return (f"stage {stage} divides by N: {'parameters, ' if stage >= 3 else ''}{'gradients, ' if stage >= 2 else ''}"
            f"{'optimizer states' if stage >= 1 else 'nothing'}; the rest stays whole (2 + 2 + 12 bytes per parameter)")


def check_zero_bytes_per_rank(fn: Any) -> CheckResult:
    """Check ``zero_bytes_per_rank(n_params, world_size, stage)`` against ``zero_memory(...)["total"]``."""
    args = [(1_000_000, 1, 0), (1_000_000, 4, 1), (1_000_000, 4, 2), (1_000_000, 4, 3), (7_500_000_000, 64, 1),
            (7_500_000_000, 64, 2), (7_500_000_000, 64, 3)]
    cases = [Case(a, zero_memory(a[0], a[1], a[2], "bf16")["total"]) for a in args]
    return check_function("zero_bytes_per_rank", fn, "zero_bytes_per_rank", cases, normalise=as_number,
                          compare=same_number, hint=_bytes_hint)


def _traffic_hint(args: tuple, got: Any) -> str:
    n_params, n, b = args
    if isinstance(got, float) and n > 1 and math.isclose(got, 2 * (n - 1) / n * n_params * b):
        return "that is data parallelism's all-reduce; ZeRO-3 all-gathers the parameters a second time for backward"
    return "each all-gather and each reduce-scatter sends (N-1)/N of the tensor from every rank; count three"


def check_zero3_bytes_sent(fn: Any) -> CheckResult:
    """Check ``zero3_bytes_sent(n_params, world_size, bytes_per_param)`` against ``zero_traffic(..., 3)``."""
    args = [(1000, 1, 2), (1000, 2, 2), (1000, 4, 4), (124_000_000, 8, 2), (7_500_000_000, 64, 2)]
    precision = {2: "bf16", 4: "fp32"}
    cases = [Case(a, zero_traffic(a[0], a[1], 3, precision[a[2]])) for a in args]
    return check_function("zero3_bytes_sent", fn, "zero3_bytes_sent", cases, normalise=as_number,
                          compare=same_number, hint=_traffic_hint)


EXERCISES = [
    Exercise("zero_bytes_per_rank", check_zero_bytes_per_rank, BYTES_STUB, solution("zero_bytes_per_rank"),
             "Write the model-state bytes on each rank under each ZeRO stage."),
    Exercise("zero3_bytes_sent", check_zero3_bytes_sent, TRAFFIC_STUB, solution("zero3_bytes_sent"),
             "Predict the bytes one rank sends per step under ZeRO-3, before section 5 counts them."),
    Exercise("zero2_step", check_zero2_step, ZERO2_STUB, solution("zero2_rank"),
             "Write ZeRO-2's step yourself, from `reduce_scatter` and `all_gather` on the flat shards of section 2 "
             "(not the library's `ZeroEngine`). The checker runs 3 AdamW steps on 2 gloo ranks against one process "
             "on the whole batch, and looks at what each rank keeps and sends."),
    Exercise("clip_grad_norm_sharded", check_clip_grad_norm_sharded, CLIP_STUB, solution("clip_grad_norm_sharded"),
             "Clip the gradient by its global norm when each rank holds only a shard of it. The checker runs 3 "
             "ZeRO-2 steps on 2 gloo ranks with your function and with `ZeroEngine.clip_grad_norm_`, and compares "
             "the clipped gradients, the norms and the parameters."),
]
