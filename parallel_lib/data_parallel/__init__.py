"""Data parallelism (chapters 01 and 02): naive and bucketed gradient averaging, the ring
all-reduce written from send/recv (its step record, its two halves reused by ZeRO, and cost model),
and the ``torchrun`` line of a multi-node job. Training with them is the one training entry's
(``parallel_lib.training``: ``Plan(dp=N, sync="bucketed")``), also from a shell::

    python -m parallel_lib.data_parallel --world-size 2 --sync bucketed
"""

from parallel_lib.data_parallel.allreduce import BucketedAllReduce, average_gradients, grad_or_zeros
from parallel_lib.data_parallel.buckets import make_buckets
from parallel_lib.data_parallel.ring import (
    Phase,
    RingStep,
    Transfer,
    algorithm_bandwidth,
    allreduce_cost,
    bus_bandwidth,
    fit_allreduce_cost,
    replay_contributions,
    require_process_group,
    ring_all_gather,
    ring_all_reduce,
    ring_chunks,
    ring_reduce_scatter,
    ring_steps,
)
from parallel_lib.data_parallel.scaleout import format_command, torchrun_command

__all__ = [
    "grad_or_zeros",
    "average_gradients",
    "make_buckets",
    "BucketedAllReduce",
    "Phase",
    "Transfer",
    "RingStep",
    "ring_chunks",
    "ring_steps",
    "replay_contributions",
    "require_process_group",
    "ring_all_reduce",
    "ring_reduce_scatter",
    "ring_all_gather",
    "allreduce_cost",
    "algorithm_bandwidth",
    "bus_bandwidth",
    "fit_allreduce_cost",
    "torchrun_command",
    "format_command",
]
