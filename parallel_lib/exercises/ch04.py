"""Exercises for chapter 04: a GPipe step's time with slow hand-overs, a micro-batch count that meets a
bubble target in the simulator, and one stage's 1F1B order (``check_clock_cycles`` and
``check_pipeline_bubble`` remain as checkers; chapter 04 prints both answers, so neither is an exercise)."""

from __future__ import annotations

import itertools
import re
from typing import Any, Optional

from parallel_lib.exercises._core import (
    solution,
    Case,
    CheckResult,
    Exercise,
    as_int,
    as_number,
    check_function,
    close,
    same_number,
    show,
)
from parallel_lib.common.timeline import idle_fraction, makespan
from parallel_lib.pipeline_parallel.schedule import Action, _clock_cycles, bubble_fraction, gpipe, one_f_one_b, simulate

__all__ = ["check_clock_cycles", "check_pipeline_bubble", "check_gpipe_step_time", "check_micro_batches_for_bubble",
           "check_one_f_one_b_order", "EXERCISES"]

CLOCK_CYCLES_STUB = '''\
def _clock_cycles(num_batches, num_partitions):
    """Yield, for each clock tick k, the list of (micro_batch i, partition j) pairs that run at tick k
    in GPipe's forward pass (micro-batch i reaches partition j at tick i + j)."""
    ...  # your code here
'''

TARGET_STUB = '''\
def micro_batches_for_bubble(p, target, stage_costs):
    """The fewest micro-batches m for which a 1F1B step of `p` stages idles at most `target` of the time.

    `stage_costs` is one (forward, backward) time per stage; the stages are NOT equal, so measure
    in the simulator: simulate(one_f_one_b(p, m), stage_costs) and idle_fraction(events)
    (from parallel_lib.pipeline_parallel and parallel_lib.common.timeline).
    """
    ...  # your code here
'''

BUBBLE_STUB = '''\
def pipeline_bubble(p, m):
    """Share of time each of `p` stages sits idle in a GPipe step of `m` micro-batches
    (every stage takes the same time for a micro-batch)."""
    ...  # your code here
'''

STEP_TIME_STUB = '''\
def gpipe_step_time(p, m, forward, backward, comm):
    """How long one GPipe training step of `p` stages and `m` micro-batches takes, when every stage
    needs `forward` for a micro-batch's forward, `backward` for its backward, and every hand-over
    of a tensor from one stage to the next (activations forward, gradients backward) takes `comm`
    on a link of its own (the stages keep computing meanwhile)."""
    ...  # your code here
'''

ONE_F_ONE_B_STUB = '''\
def one_f_one_b_order(stage, num_stages, num_micro_batches):
    """The order in which `stage` runs its work in a 1F1B schedule, as strings like "F0" and "B0".

    Work the rule out from the 1F1B schedules printed in this chapter (4 stages, 6 micro-batches)
    and the animation: it must hold for any number of stages and micro-batches.
    """
    ...  # your code here
'''

_CLOCK_SHAPES = [(1, 1), (3, 3), (4, 2), (2, 4), (1, 3), (3, 1), (5, 3)]


def _as_ticks(value: Any) -> list[list[tuple[int, int]]]:
    try:  # a generator has already been turned into a list by check_function
        return [sorted((as_int(i), as_int(j)) for i, j in tick) for tick in value]
    except (TypeError, ValueError):
        raise TypeError("an iterable of ticks, each a list of (micro_batch, partition) pairs") from None


def _compare_ticks(expected: list[list[tuple[int, int]]], got: list[list[tuple[int, int]]]) -> Optional[str]:
    for k, (want, have) in enumerate(zip(expected, got)):
        if want != have:
            return f"tick {k}: expected {want}, got {have} (pairs within a tick may come in any order)"
    if len(got) != len(expected):
        return f"expected m + n - 1 = {len(expected)} tick(s), got {len(got)}: {show(got, 200)}"
    return None


def check_clock_cycles(fn: Any) -> CheckResult:
    """Check ``_clock_cycles(num_batches, num_partitions)`` against the library's own ``_clock_cycles``."""
    cases = [Case(shape, [sorted(tick) for tick in _clock_cycles(*shape)]) for shape in _CLOCK_SHAPES]
    return check_function("clock_cycles", fn, "_clock_cycles", cases, normalise=_as_ticks, compare=_compare_ticks,
                          hint=lambda args, got: "micro-batch i reaches partition j at tick k = i + j; "
                                                 "the pipeline fills for n - 1 ticks and drains for n - 1")


def _bubble_hint(args: tuple, got: Any) -> str:
    p, m = args
    if isinstance(got, float) and close((p - 1) / m, got):
        return ("(p - 1) / m is the approximation for m >> p; the step takes m + p - 1 ticks, "
                "of which each stage is idle for p - 1")
    return "count ticks: the step lasts m + p - 1 ticks and each stage works during m of them"


def check_pipeline_bubble(fn: Any) -> CheckResult:
    """Check ``pipeline_bubble(p, m)`` against ``parallel_lib.pipeline_parallel.bubble_fraction``."""
    shapes = [(4, 8), (2, 4), (1, 5), (4, 1), (8, 32), (3, 3)]
    cases = [Case(shape, bubble_fraction(*shape)) for shape in shapes]
    return check_function("pipeline_bubble", fn, "pipeline_bubble", cases, normalise=as_number,
                          compare=same_number, hint=_bubble_hint)


def _simulated_step(p: int, m: int, forward: float, backward: float, comm: float) -> float:
    return makespan(simulate(gpipe(p, m), (forward, backward), comm=comm))


def _step_time_hint(args: tuple, got: Any) -> str:
    p, m, forward, backward, comm = args
    if not isinstance(got, float):
        return ""
    compute = (m + p - 1) * (forward + backward)
    guesses = {compute: "that is the step without hand-overs: how many of them lie on the path that ends the step?",
               compute + (p - 1) * comm: "the gradients cross the same p - 1 boundaries on the way back",
               compute + 2 * (m + p - 1) * comm: "a hand-over does not hold its stage: only those on the critical "
                                                 "path (the first micro-batch down, the last one back) add up",
               m * (p * (forward + backward) + 2 * (p - 1) * comm): "the micro-batches overlap: that is running "
                                                                   "them one after another"}
    for value, hint in guesses.items():
        if close(value, got):
            return hint
    return "follow micro-batch 0 down the stages and the last micro-batch back up: which waits are on that path?"


def check_gpipe_step_time(fn: Any) -> CheckResult:
    """Check ``gpipe_step_time(p, m, forward, backward, comm)`` against the simulator's GPipe step."""
    shapes = [(2, 1, 1.0, 2.0, 0.0), (4, 6, 1.0, 2.0, 0.25), (2, 4, 1.0, 2.0, 0.5), (1, 3, 1.0, 2.0, 5.0),
              (5, 8, 0.5, 1.0, 2.0), (3, 2, 2.0, 3.0, 1.0)]
    cases = [Case(shape, _simulated_step(*shape)) for shape in shapes]
    return check_function("gpipe_step_time", fn, "gpipe_step_time", cases, normalise=as_number, compare=same_number,
                          hint=_step_time_hint)


_ACTION = re.compile(r"^([FB])(\d+)$")


def _as_action(item: Any) -> str:
    if isinstance(item, Action):
        return str(item)
    if isinstance(item, (tuple, list)) and len(item) == 2:
        item = f"{item[0]}{item[1]}"
    if isinstance(item, str) and _ACTION.match(item.strip().upper()):
        return item.strip().upper()
    raise TypeError('a list of strings like "F0" (forward of micro-batch 0) and "B0" (its backward)')


def _as_order(value: Any) -> list[str]:
    if isinstance(value, str) or not hasattr(value, "__iter__"):
        raise TypeError('a list of strings like "F0" and "B0"')
    return [_as_action(item) for item in value]


def _order_hint(args: tuple, got: Any) -> str:
    stage, p, m = args
    if got == [str(a) for a in gpipe(p, m).stages[stage]]:
        return "that is GPipe's order (all forwards, then all backwards); 1F1B starts backwards early"
    forwards_first = len(list(itertools.takewhile(lambda a: a.startswith("F"), got)))
    expected = min(p - stage, m)
    if forwards_first != expected:
        return (f"stage {stage} runs min(p - 1 - stage, m) = {min(p - 1 - stage, m)} warm-up forwards, then "
                f"one more forward before its first backward: {expected} forwards first, not {forwards_first}")
    return "after the warm-up, alternate: one forward, then the backward of the oldest micro-batch"


def check_one_f_one_b_order(fn: Any) -> CheckResult:
    """Check ``one_f_one_b_order(stage, num_stages, num_micro_batches)`` against ``one_f_one_b``."""
    shapes = [(0, 4, 8), (3, 4, 8), (1, 4, 8), (0, 4, 2), (2, 3, 3), (0, 1, 3), (0, 3, 1)]
    cases = [Case(shape, [str(a) for a in one_f_one_b(shape[1], shape[2]).stages[shape[0]]]) for shape in shapes]
    return check_function("one_f_one_b_order", fn, "one_f_one_b_order", cases, normalise=_as_order, hint=_order_hint)


_MAX_M = 512  # the checker's targets are all met well below this


def _simulated_bubble(p: int, m: int, stage_costs: Any) -> float:
    return idle_fraction(simulate(one_f_one_b(p, m), stage_costs))


def _fewest_micro_batches(p: int, target: float, stage_costs: Any) -> int:
    return next(m for m in range(1, _MAX_M + 1) if _simulated_bubble(p, m, stage_costs) <= target)


def _target_hint(args: tuple, got: Any) -> str:
    p, target, costs = args
    if not isinstance(got, int) or got < 1:
        return ""
    formula = next(m for m in range(1, _MAX_M + 1) if bubble_fraction(p, m) <= target)
    if got == formula:
        return ("(p-1)/(m+p-1) assumes equal stages; with these costs the slowest stage sets the pace and the "
                "others wait: simulate the schedule and measure idle_fraction")
    bubble = _simulated_bubble(p, got, costs)
    if bubble > target:
        return f"with m={got} the simulated step idles {bubble:.1%} > {target:.1%}: more micro-batches"
    return f"m={got - 1} already idles {_simulated_bubble(p, got - 1, costs):.1%} <= {target:.1%}: fewer will do"


def check_micro_batches_for_bubble(fn: Any) -> CheckResult:
    """Check ``micro_batches_for_bubble(p, target, stage_costs)`` against ``simulate`` + ``idle_fraction``."""
    shapes = [(2, 0.2, [(1.0, 2.0), (1.0, 2.0)]), (4, 0.25, [(1.0, 2.0)] * 4),
              (4, 0.45, [(1.0, 2.0), (1.0, 2.0), (1.0, 2.0), (2.0, 4.0)]),
              (3, 0.4, [(2.0, 4.0), (1.0, 2.0), (1.0, 2.0)]), (1, 0.0, [(1.0, 2.0)])]
    cases = [Case(shape, _fewest_micro_batches(*shape)) for shape in shapes]
    return check_function("micro_batches_for_bubble", fn, "micro_batches_for_bubble", cases, normalise=as_int,
                          hint=_target_hint)


# clock_cycles and pipeline_bubble stay importable (their checkers) but are no exercises: chapter 04 prints both.
EXERCISES = [
    Exercise("gpipe_step_time", check_gpipe_step_time, STEP_TIME_STUB, solution("gpipe_step_time"),
             "Write `gpipe_step_time(p, m, forward, backward, comm)`: how long a GPipe step takes when every "
             "hand-over between two stages costs `comm`. The bubble formula above assumes free hand-overs; "
             "which of them lengthen the step, and which hide behind other work? The checker compares with "
             "the simulator."),
    Exercise("micro_batches_for_bubble", check_micro_batches_for_bubble, TARGET_STUB,
             solution("micro_batches_for_bubble"),
             "Write `micro_batches_for_bubble(p, target, stage_costs)`: the fewest micro-batches that bring a "
             "1F1B step with unequal stages under an idle `target`, measured in the simulator. When does the "
             "formula (p-1)/(m+p-1) give the wrong answer?"),
    Exercise("one_f_one_b_order", check_one_f_one_b_order, ONE_F_ONE_B_STUB, solution("one_f_one_b_order"),
             "Write `one_f_one_b_order(stage, num_stages, num_micro_batches)`: the order in which one stage runs "
             "its forwards and backwards under 1F1B."),
]
