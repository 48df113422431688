"""Pipeline parallelism (chapters 04 and 08): schedules as data (``clock_cycles``, GPipe, 1F1B,
interleaved 1F1B, ZB-H1, ZB-H2, ZBV; validator, hang gallery, simulator), micro-batches, the one
runtime (:func:`run_actions`: a rank's actions over threads or processes), worker threads, the
threaded :class:`Pipe`, and GPT-2 cut into stages.
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
    stage_blocks,
)
from parallel_lib.pipeline_parallel.generators import interleaved_1f1b, zb_h1, zb_h2, zbv
from parallel_lib.pipeline_parallel.dualpipe import dualpipev
from parallel_lib.pipeline_parallel.hangs import check_blocking, check_schedule, hang_gallery, parse_schedule
from parallel_lib.pipeline_parallel.live_deadlock import send_first
from parallel_lib.pipeline_parallel.pipe import Pipe, StageError
from parallel_lib.pipeline_parallel.runtime import RankStages, run_actions
from parallel_lib.pipeline_parallel.schedule import (
    ALL_SCHEDULES,
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
    stages_per_rank,
    validate_schedule,
)
from parallel_lib.pipeline_parallel.simulator import SimResult, simulate_schedule
from parallel_lib.pipeline_parallel.stage import StageRunner, TensorOrTensors
from parallel_lib.pipeline_parallel.timeline_stats import in_flight, stage_costs_from_events
from parallel_lib.pipeline_parallel.worker import THREAD_PREFIX, Task, Workers

__all__ = [
    "send_first",
    "GPT2Embedding",
    "GPT2Blocks",
    "GPT2Head",
    "GPT2Stages",
    "gpt2_stages",
    "lm_loss",
    "Target",
    "split_layers",
    "stage_blocks",
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
    "run_actions",
    "RankStages",
    "clock_cycles",
    "_clock_cycles",
    "Action",
    "Schedule",
    "SCHEDULES",
    "ALL_SCHEDULES",
    "stages_per_rank",
    "interleaved_1f1b",
    "zb_h1",
    "zb_h2",
    "zbv",
    "dualpipev",
    "check_blocking",
    "check_schedule",
    "hang_gallery",
    "parse_schedule",
    "SimResult",
    "simulate_schedule",
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
