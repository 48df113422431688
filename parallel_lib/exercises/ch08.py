"""Exercises for chapter 08: the interleaved bubble, a schedule that meets a bubble target within a
memory limit, and a deadlock to find and repair."""

from __future__ import annotations

from typing import Any, Optional

from parallel_lib.exercises._core import Case, CheckResult, Exercise, as_number, check_function, failed, passed, same_number
from parallel_lib.pipeline_parallel.generators import interleaved_1f1b
from parallel_lib.pipeline_parallel.hangs import parse_schedule
from parallel_lib.pipeline_parallel.simulator import peak_in_flight, simulate_schedule, validate_schedule

__all__ = ["check_interleaved_bubble", "check_fill_the_bubble", "check_repair_deadlock", "EXERCISES",
           "FILL_SOLUTION", "REPAIR_SOLUTION"]

INTERLEAVED_STUB = '''\
def interleaved_bubble(p, m, v):
    """Bubble of interleaved 1F1B with p ranks, m micro-batches and v model stages per rank,
    relative to the ideal step m·(F+B) (every stage costs the same; m a multiple of p).
    Hint: each rank's fill and drain are made of stage-sized pieces, 1/v of a rank's share."""
    ...  # your code here
'''

FILL_STUB = '''\
# p = 2 ranks, m = 4 micro-batches, F, B (input gradient) and W (weight gradient) each cost 1 tick.
# Write each rank's order as a string like "F0 F1 B0 W0 ..." so that the simulated bubble is at
# most 1/12 (1F1B's is 1/4) while no rank ever holds more than 2 micro-batches (F done, W not yet).
fill_the_bubble = None  # your answer: ["rank 0's order", "rank 1's order"]
'''

REPAIR_STUB = '''\
# Rank 0 runs "F0 B0 F1 B1". Rank 1 runs "F0 F1 B1 B0", and the pipeline hangs before it starts
# its second action. Why? Give rank 1 an order (keep rank 0's) with which the schedule runs and
# rank 1 never holds more than one micro-batch.
repair_deadlock = None  # your answer: rank 1's order, e.g. "F0 ..."
'''

FILL_SOLUTION = ["F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3", "F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3"]
REPAIR_SOLUTION = "F0 B0 F1 B1"


def solution_interleaved_bubble(p: int, m: int, v: int) -> float:
    return (p - 1) / (v * m)


def check_interleaved_bubble(fn: Any) -> CheckResult:
    """Check ``interleaved_bubble(p, m, v)`` against the simulated interleaved schedule."""
    shapes = [(2, 4, 2), (4, 8, 2), (4, 8, 1), (3, 9, 3), (8, 16, 2)]
    cases = [Case(shape, simulate_schedule(interleaved_1f1b(*shape), (1.0, 2.0)).bubble) for shape in shapes]

    def hint(args: tuple, got: Any) -> str:
        p, m, v = args
        if isinstance(got, float) and abs(got - (p - 1) / m) < 1e-9:
            return "that is 1F1B's (p - 1) / m: with v stages per rank each fill step is 1/v as long"
        return "the fill and drain take (p - 1) stage-times of 1/v of a rank's share each"
    return check_function("interleaved_bubble", fn, "interleaved_bubble", cases, normalise=as_number,
                          compare=same_number, hint=hint)


def _parse(name: str, rows: Any) -> tuple[Optional[Any], str]:
    try:
        if isinstance(rows, str) or len(rows) != 2:
            return None, "a list of two strings, one per rank"
        schedule = parse_schedule(name, *rows)
        validate_schedule(schedule)
        return schedule, ""
    except (TypeError, ValueError, IndexError, KeyError) as error:
        return None, str(error)


def check_fill_the_bubble(answer: Any) -> CheckResult:
    """The orders must validate, keep every rank at <= 2 micro-batches and reach a bubble <= 1/12."""
    if answer is None or answer is Ellipsis:
        return failed("fill_the_bubble", None, "fill_the_bubble is not answered yet (it is still None)")
    schedule, problem = _parse("yours", answer)
    if schedule is None:
        return failed("fill_the_bubble", None, f"the schedule does not run: {problem}")
    if schedule.num_micro_batches != 4 or not schedule.split_backward:
        return failed("fill_the_bubble", None, "use micro-batches 0..3 and split every backward into B and W")
    peak = peak_in_flight(schedule)
    if max(peak) > 2:
        return failed("fill_the_bubble", None, f"ranks hold {peak} micro-batches at their peak; the limit is 2",
                      "run each W soon enough that the next forward stays within the limit")
    bubble = simulate_schedule(schedule, (1.0, 1.0, 1.0)).bubble
    if bubble > 1 / 12 + 1e-9:
        return failed("fill_the_bubble", None, f"the bubble is {bubble:.3f}, above 1/12 = {1 / 12:.3f}",
                      "put off a W on rank 1 so that it can fill the wait at the end of rank 1's list")
    return passed("fill_the_bubble", f"bubble {bubble:.3f} at peak {peak}")


def check_repair_deadlock(answer: Any) -> CheckResult:
    """Rank 1's order must run with rank 0's ``F0 B0 F1 B1`` and hold at most one micro-batch."""
    if answer is None or answer is Ellipsis:
        return failed("repair_deadlock", None, "repair_deadlock is not answered yet (it is still None)")
    if not isinstance(answer, str):
        return failed("repair_deadlock", None, 'the answer must be one string such as "F0 B0 ..."')
    schedule, problem = _parse("repaired", ["F0 B0 F1 B1", answer])
    if schedule is None:
        return failed("repair_deadlock", None, f"the schedule does not run: {problem}",
                      "rank 0 needs B0 from rank 1 before it can send F1")
    if peak_in_flight(schedule)[1] > 1:
        return failed("repair_deadlock", None, "rank 1 holds 2 micro-batches at once; the limit is 1")
    return passed("repair_deadlock", "the schedule validates")


EXERCISES = [
    Exercise("interleaved_bubble", check_interleaved_bubble, INTERLEAVED_STUB, solution_interleaved_bubble),
    Exercise("fill_the_bubble", check_fill_the_bubble, FILL_STUB, FILL_SOLUTION),
    Exercise("repair_deadlock", check_repair_deadlock, REPAIR_STUB, REPAIR_SOLUTION),
]
