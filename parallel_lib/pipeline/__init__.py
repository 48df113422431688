"""Pipeline parallelism: schedules as data, and a threaded executor that runs them.

- :mod:`.schedule`: ``_clock_cycles``, the GPipe and 1F1B schedules as per-stage
  action lists, their validator, the simulator and the bubble formula;
- :mod:`.pipe`: :class:`Pipe`, which executes those same schedules on one worker
  thread per stage (:mod:`.worker`), forward and backward;
- :mod:`.gpt2`: a GPT-2 cut into pipeline stages by a device map.
"""

from .gpt2 import GPT2Stages, gpt2_stages, lm_loss
from .pipe import Pipe, StageError
from .schedule import (Action, Schedule, bubble_fraction, gpipe, in_flight, make_schedule, one_f_one_b, simulate,
                       stage_costs_from_events, validate_schedule)

__all__ = [
    "Action",
    "Schedule",
    "gpipe",
    "one_f_one_b",
    "make_schedule",
    "validate_schedule",
    "simulate",
    "bubble_fraction",
    "stage_costs_from_events",
    "in_flight",
    "Pipe",
    "StageError",
    "GPT2Stages",
    "gpt2_stages",
    "lm_loss",
]
