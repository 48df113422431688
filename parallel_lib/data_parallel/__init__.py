"""Data parallelism (chapters 01 and 02): naive and bucketed gradient averaging, the ring
all-reduce written from send/recv (its step record, its two halves reused by ZeRO, and cost model), and DP training::

    python -m parallel_lib.data_parallel --world-size 2 --sync bucketed
"""

from parallel_lib.data_parallel.allreduce import BucketedAllReduce, average_gradients, grad_or_zeros
from parallel_lib.data_parallel.cli import save_run, saved_run
from parallel_lib.data_parallel.dp import (
    PHASES,
    SYNC_METHODS,
    DPConfig,
    DPResult,
    prepare_replica,
    run_dp,
    run_dp_many,
    train_replica,
)
from parallel_lib.data_parallel.dp_reference import single_process_reference, summarize
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
from parallel_lib.data_parallel.scaleout import REHEARSAL, format_command, torchrun_command, train_and_save

__all__ = [
    "grad_or_zeros",
    "average_gradients",
    "BucketedAllReduce",
    "SYNC_METHODS",
    "PHASES",
    "DPConfig",
    "DPResult",
    "prepare_replica",
    "run_dp",
    "run_dp_many",
    "train_replica",
    "single_process_reference",
    "summarize",
    "saved_run",
    "save_run",
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
    "REHEARSAL",
    "torchrun_command",
    "format_command",
    "train_and_save",
]
