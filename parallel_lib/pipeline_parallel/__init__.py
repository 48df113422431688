"""Pipeline parallelism (chapter 04): schedules as data (``clock_cycles``, GPipe, 1F1B,
validator, simulator), micro-batches, worker threads, the threaded :class:`Pipe`, and GPT-2
cut into stages.
"""

from parallel_lib.pipeline_parallel.gpt2 import GPT2Blocks, GPT2Embedding, GPT2Head, GPT2Stages, gpt2_stages, lm_loss
from parallel_lib.pipeline_parallel.microbatch import (
    Target,
    check_layers,
    check_split,
    gather,
    loss_weights,
    scatter,
    split_layers,
    split_like,
)
from parallel_lib.pipeline_parallel.pipe import Pipe, StageError
from parallel_lib.pipeline_parallel.schedule import (
    SCHEDULES,
    Action,
    Schedule,
    _clock_cycles,
    action_ready,
    bubble_fraction,
    clock_cycles,
    gpipe,
    make_schedule,
    one_f_one_b,
    simulate,
    stage_lane,
    validate_schedule,
)
from parallel_lib.pipeline_parallel.stage import StageRunner, TensorOrTensors
from parallel_lib.pipeline_parallel.timeline_stats import in_flight, stage_costs_from_events
from parallel_lib.pipeline_parallel.worker import THREAD_PREFIX, Task, Workers

__all__ = [
    "GPT2Embedding",
    "GPT2Blocks",
    "GPT2Head",
    "GPT2Stages",
    "gpt2_stages",
    "lm_loss",
    "Target",
    "split_layers",
    "scatter",
    "gather",
    "check_layers",
    "StageRunner",
    "TensorOrTensors",
    "check_split",
    "split_like",
    "loss_weights",
    "Pipe",
    "StageError",
    "clock_cycles",
    "_clock_cycles",
    "Action",
    "Schedule",
    "SCHEDULES",
    "gpipe",
    "one_f_one_b",
    "make_schedule",
    "validate_schedule",
    "simulate",
    "bubble_fraction",
    "stage_lane",
    "action_ready",
    "stage_costs_from_events",
    "in_flight",
    "Task",
    "Workers",
    "THREAD_PREFIX",
]
