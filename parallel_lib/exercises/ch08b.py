"""Exercises for chapter 08b (V shapes, the hang gallery, schedules run for real): the schedule lab
(``ch08_schedule_lab``) and a deadlock to repair (a warm-up). The reference answers are in ``solutions.py``."""

from __future__ import annotations

from typing import Any, Optional

from parallel_lib.exercises._core import CheckResult, Exercise, failed, passed, solution
from parallel_lib.exercises.ch08_schedule_lab import SCHEDULE_LAB_STUB, check_schedule_lab
from parallel_lib.pipeline_parallel.hangs import check_schedule, parse_schedule
from parallel_lib.pipeline_parallel.schedule import Schedule
from parallel_lib.pipeline_parallel.simulator import peak_in_flight

__all__ = ["check_schedule_lab", "check_repair_deadlock", "EXERCISES"]

REPAIR_STUB = '''\
# Rank 0 runs "F0 B0 F1 B1". Rank 1 runs "F0 F1 B1 B0", and the pipeline hangs before rank 1 starts
# its second action. Give rank 1 an order (keep rank 0's) with which the schedule passes every check
# of the hang gallery and rank 1 never holds more than one micro-batch.
repair_deadlock = None  # your answer: rank 1's order, e.g. "F0 ..."
'''


def _repaired(answer: str) -> tuple[Optional[Schedule], str]:
    try:
        schedule = parse_schedule("repaired", "F0 B0 F1 B1", answer)
        check_schedule(schedule)  # the validator, then NCCL's blocking rule on paired exchanges
        return schedule, ""
    except (TypeError, ValueError, IndexError, KeyError) as error:
        return None, str(error)


def check_repair_deadlock(answer: Any) -> CheckResult:
    """Rank 1's order must pass ``check_schedule`` with rank 0's ``F0 B0 F1 B1`` and hold at most one micro-batch."""
    if answer is None or answer is Ellipsis:
        return failed("repair_deadlock", None, "repair_deadlock is not answered yet (it is still None)")
    if not isinstance(answer, str):
        return failed("repair_deadlock", None, 'the answer must be one string such as "F0 B0 ..."')
    schedule, problem = _repaired(answer)
    if schedule is None:
        return failed("repair_deadlock", None, f"the schedule does not run: {problem}",
                      "rank 0 needs B0 from rank 1 before it can send F1")
    if peak_in_flight(schedule)[1] > 1:
        return failed("repair_deadlock", None, "rank 1 holds 2 micro-batches at once; the limit is 1")
    return passed("repair_deadlock", "the schedule passes the validator and the blocking check")


EXERCISES = [
    Exercise("schedule_lab", check_schedule_lab, SCHEDULE_LAB_STUB, solution("SCHEDULE_LAB"),
             "The schedule lab: write every rank's actions for 4 ranks and 8 micro-batches so that, with a W "
             "that costs twice B, the bubble is at most 0.07 and no rank holds more than 5 micro-batches. The "
             "checker runs the validator, the NCCL blocking check and the simulator, then your schedule on the "
             "`Pipe`, and compares every gradient with the unsplit model's. No built-in schedule passes: "
             "ZB-H1 keeps too much idle time, ZB-H2 holds too much memory."),
    Exercise("repair_deadlock", check_repair_deadlock, REPAIR_STUB, solution("REPAIR_DEADLOCK"),
             "Warm-up: repair the schedule of the hang gallery's last exhibit (rank 1's order only)."),
]
