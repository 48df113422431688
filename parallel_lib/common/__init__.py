"""What every chapter shares: timeline events, GPT-2 by size, the training loop,
argument checks and markdown tables.
"""

from parallel_lib.common.activations import ActivationStep, measure_step_activations, set_recomputation
from parallel_lib.common.checks import check_choice, check_int, check_number, positive_int, positive_number
from parallel_lib.common.machine_speed import MachineSpeed, measure_machine_speed
from parallel_lib.common.models import GPT2_SIZES, build_gpt2, count_parameters, gpt2_config
from parallel_lib.common.saved_tensors import SavedTensors
from parallel_lib.common.tables import markdown_table
from parallel_lib.common.timeline import (
    DeviceClock,
    Event,
    TimelineRecorder,
    busy_time,
    idle_fraction,
    lanes,
    makespan,
    max_concurrency,
    synchronize_devices,
)
from parallel_lib.common.training import (TrainRecord, busy_machine_warning, evaluate, forward_loss, train,
                                         weighted_cross_entropy)

__all__ = [
    "SavedTensors",
    "set_recomputation",
    "ActivationStep",
    "measure_step_activations",
    "check_int",
    "positive_int",
    "check_number",
    "positive_number",
    "check_choice",
    "MachineSpeed",
    "measure_machine_speed",
    "GPT2_SIZES",
    "gpt2_config",
    "build_gpt2",
    "count_parameters",
    "markdown_table",
    "Event",
    "TimelineRecorder",
    "synchronize_devices",
    "DeviceClock",
    "lanes",
    "makespan",
    "busy_time",
    "max_concurrency",
    "idle_fraction",
    "TrainRecord",
    "busy_machine_warning",
    "weighted_cross_entropy",
    "forward_loss",
    "train",
    "evaluate",
]
