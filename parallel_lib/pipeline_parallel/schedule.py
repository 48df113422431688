"""Pipeline schedules as data: what each stage does, in order, for GPipe and 1F1B.

A schedule is, for every stage, the ordered list of its actions ``F(i)`` (forward
of micro-batch i) and ``B(i)`` (backward of micro-batch i). Nothing else: no
clock, no threads, no torch. Keeping it plain data lets one object drive three
consumers that must agree, so what a reader sees is what runs:

- :class:`parallel_lib.pipeline_parallel.Pipe` executes each stage's list in its worker thread;
- :func:`simulate` replays it with given stage costs and returns timeline events;
- the animation in :mod:`parallel_lib.viz.schedule` draws what :func:`simulate` returns.

Letters used throughout: ``i`` micro-batch, ``j`` stage (partition), ``k`` clock
tick, ``m`` number of micro-batches, ``p`` number of stages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Container, Iterator, Literal, Sequence, Union

from parallel_lib.common.checks import positive_int
from parallel_lib.common.timeline import Event

__all__ = [
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
]

Kind = Literal["F", "B"]
StageCost = tuple[float, float]  # (forward seconds or ticks, backward seconds or ticks)


@dataclass(frozen=True)
class Action:
    """One unit of stage work: ``F`` (forward) or ``B`` (backward) of micro-batch ``micro_batch``."""

    kind: Kind
    micro_batch: int

    def __post_init__(self) -> None:
        if self.kind not in ("F", "B"):
            raise ValueError(f"kind must be 'F' or 'B', got kind={self.kind!r}")

    @property
    def event_kind(self) -> str:
        """The :class:`parallel_lib.common.timeline.Event` kind of this action."""
        return "forward" if self.kind == "F" else "backward"

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}"


@dataclass(frozen=True)
class Schedule:
    """Per-stage ordered actions of one pipeline schedule.

    Attributes:
        name: "gpipe" or "1f1b" (or a free-form name for a hand-written schedule).
        num_stages: p.
        num_micro_batches: m.
        stages: ``stages[j]`` is stage j's actions in the order it runs them.
    """

    name: str
    num_stages: int
    num_micro_batches: int
    stages: tuple[tuple[Action, ...], ...]

    def forward_only(self) -> Schedule:
        """The same schedule without its backward actions (inference)."""
        return Schedule(f"{self.name} (forward)", self.num_stages, self.num_micro_batches,
                        tuple(tuple(a for a in actions if a.kind == "F") for actions in self.stages))

    def __str__(self) -> str:
        rows = [f"stage {j}: " + " ".join(str(a) for a in actions) for j, actions in enumerate(self.stages)]
        return "\n".join([f"{self.name}, p={self.num_stages}, m={self.num_micro_batches}", *rows])


def clock_cycles(num_batches: int, num_partitions: int) -> Iterator[list[tuple[int, int]]]:
    """GPipe's forward wavefront: the ``(i, j)`` pairs that run at each clock tick ``k``.

    Micro-batch i reaches partition j at tick ``k = i + j``: the pipeline fills for
    ``p - 1`` ticks, runs full, and drains for ``p - 1`` ticks, ``m + p - 1`` in all.
    """
    # i: micro-batch, j: partition, k: clock tick.  m = p = 3:
    #
    #   k | (i,j)  (i,j)  (i,j)
    #   --+--------------------
    #   0 | (0,0)
    #   1 | (1,0)  (0,1)
    #   2 | (2,0)  (1,1)  (0,2)
    #   3 |        (2,1)  (1,2)
    #   4 |               (2,2)
    for k in range(num_batches + num_partitions - 1):
        yield [(k - j, j) for j in range(max(0, k - num_batches + 1), min(k + 1, num_partitions))]


_clock_cycles = clock_cycles  # the name torchgpipe and the source article use


def _check_sizes(p: int, m: int) -> None:
    positive_int("p", p)
    positive_int("m", m)


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: every stage runs all m forwards, then all m backwards in reverse order.

    Each stage holds the activations of all m micro-batches at the turn from
    forward to backward.
    """
    _check_sizes(p, m)
    forwards = [Action("F", i) for i in range(m)]
    backwards = [Action("B", i) for i in reversed(range(m))]
    return Schedule("gpipe", p, m, tuple(tuple(forwards + backwards) for _ in range(p)))


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush): warm-up forwards, then one forward / one backward, then cool-down.

    Stage j first runs ``w = min(p - 1 - j, m)`` warm-up forwards, then alternates
    ``F(w + n)``, ``B(n)`` while forwards remain, then runs the remaining backwards.
    It therefore holds at most ``p - j <= p`` micro-batches' activations, instead of
    GPipe's m, at the same bubble when forward and backward costs are balanced.
    """
    _check_sizes(p, m)
    stages = []
    for j in range(p):
        warmup = min(p - 1 - j, m)
        actions = [Action("F", i) for i in range(warmup)]
        for n in range(m - warmup):  # steady state: one forward in, one backward out
            actions += [Action("F", warmup + n), Action("B", n)]
        actions += [Action("B", i) for i in range(m - warmup, m)]  # cool-down
        stages.append(tuple(actions))
    return Schedule("1f1b", p, m, tuple(stages))


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def make_schedule(name: str, p: int, m: int) -> Schedule:
    """The schedule called ``name`` ("gpipe" or "1f1b") for p stages and m micro-batches.

    Raises:
        ValueError: an unknown name, or p, m below 1.
    """
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got schedule={name!r}")
    return SCHEDULES[name](p, m)


def stage_lane(j: int) -> str:
    """Timeline lane of stage j, shared by measured and simulated runs."""
    return f"stage {j}"


def action_ready(schedule: Schedule, j: int, action: Action, done: Container[tuple[str, int, int]]) -> bool:
    """Whether stage j may start ``action`` once ``done`` holds the finished (kind, stage, i)."""
    i = action.micro_batch
    if action.kind == "F":
        return j == 0 or ("F", j - 1, i) in done
    has_next = j + 1 < schedule.num_stages
    return ("F", j, i) in done and (not has_next or ("B", j + 1, i) in done)


def _run_order(schedule: Schedule, costs: Sequence[StageCost]) -> list[tuple[int, Action, float, float]]:
    """List-schedule the actions: each starts when its stage is free and its inputs exist.

    Returns ``(stage, action, start, end)`` in completion order. Raises ValueError on
    a deadlock: a stage waits on an action that can never run before it.
    """
    p = schedule.num_stages
    position = [0] * p
    stage_free = [0.0] * p
    finished: dict[tuple[str, int, int], float] = {}
    order: list[tuple[int, Action, float, float]] = []
    total = sum(len(actions) for actions in schedule.stages)
    while len(order) < total:
        candidates = []
        for j in range(p):
            if position[j] == len(schedule.stages[j]):
                continue
            action = schedule.stages[j][position[j]]
            if action_ready(schedule, j, action, finished):
                i = action.micro_batch
                inputs = [finished.get((action.kind, j - 1 if action.kind == "F" else j + 1, i), 0.0),
                          finished.get(("F", j, i), 0.0)]
                candidates.append((max(stage_free[j], *inputs), j, action))
        if not candidates:
            blocked = {f"stage {j}": str(schedule.stages[j][position[j]])
                       for j in range(p) if position[j] < len(schedule.stages[j])}
            raise ValueError(f"schedule {schedule.name!r} deadlocks: every stage waits for an action "
                             f"that cannot run first; next actions: {blocked}")
        start, j, action = min(candidates, key=lambda c: (c[0], c[1]))
        end = start + costs[j][0 if action.kind == "F" else 1]
        finished[(action.kind, j, action.micro_batch)] = end
        stage_free[j] = end
        position[j] += 1
        order.append((j, action, start, end))
    return order


def validate_schedule(schedule: Schedule, require_backward: bool = True) -> None:
    """Check that a schedule can run and computes every gradient exactly once.

    Rules: each stage runs ``F(i)`` (and ``B(i)`` when ``require_backward``) exactly
    once for every micro-batch; a stage's ``B(i)`` comes after its own ``F(i)``;
    ``F(i)`` on stage j needs stage j-1's ``F(i)`` and ``B(i)`` needs stage j+1's
    ``B(i)``, and the per-stage orders must allow all of that without a deadlock.

    Raises:
        ValueError: no stage or no micro-batch, or naming the stage and the action that breaks a rule.
    """
    positive_int("num_stages", schedule.num_stages)  # a schedule of nothing would pass every rule below
    positive_int("num_micro_batches", schedule.num_micro_batches)
    if len(schedule.stages) != schedule.num_stages:
        raise ValueError(f"schedule has {len(schedule.stages)} stage lists for "
                         f"num_stages={schedule.num_stages}")
    kinds = ("F", "B") if require_backward else ("F",)
    expected = sorted((kind, i) for kind in kinds for i in range(schedule.num_micro_batches))
    for j, actions in enumerate(schedule.stages):
        if sorted((a.kind, a.micro_batch) for a in actions) != expected:
            wanted = " ".join(f"{kind}{i}" for kind, i in expected)
            raise ValueError(f"stage {j} must run each of {wanted} once, got {' '.join(map(str, actions))}")
        seen: set[int] = set()
        for action in actions:
            if action.kind == "B" and action.micro_batch not in seen:
                raise ValueError(f"stage {j} runs {action} before F{action.micro_batch}")
            if action.kind == "F":
                seen.add(action.micro_batch)
    _run_order(schedule, [(1.0, 1.0)] * schedule.num_stages)


def _normalise_costs(stage_costs: Union[StageCost, Sequence[StageCost]], p: int) -> list[StageCost]:
    if (isinstance(stage_costs, (tuple, list)) and len(stage_costs) == 2
            and all(isinstance(c, (int, float)) for c in stage_costs)):
        costs = [tuple(stage_costs)] * p  # one (forward, backward) pair for every stage
    else:
        costs = [tuple(c) for c in stage_costs]  # type: ignore[union-attr]
    if len(costs) != p or any(len(c) != 2 or not all(math.isfinite(x) and x >= 0 for x in c) for c in costs):
        raise ValueError(f"stage_costs must be one (forward, backward) pair of finite, non-negative costs or "
                         f"{p} of them (one per stage), got stage_costs={stage_costs!r}")
    return costs  # type: ignore[return-value]


def simulate(schedule: Schedule, stage_costs: Union[StageCost, Sequence[StageCost]] = (1.0, 1.0)) -> list[Event]:
    """Replay a schedule with fixed costs and return its timeline.

    Every stage runs its actions in order, each as soon as the stage is free and
    its input (previous stage's forward, next stage's backward) has finished;
    communication is free. With unit costs the times are clock ticks.

    Args:
        schedule: the schedule to replay (it is validated first).
        stage_costs: ``(forward, backward)`` cost for every stage, or one such pair per stage.

    Returns:
        One :class:`Event` per action on lanes ``"stage j"``, in completion order.

    Raises:
        ValueError: an invalid schedule, badly shaped ``stage_costs`` or a cost that is
            negative, NaN or infinite.
    """
    costs = _normalise_costs(stage_costs, schedule.num_stages)
    validate_schedule(schedule, require_backward=any(a.kind == "B" for a in schedule.stages[0]))
    return [Event(stage_lane(j), action.event_kind, action.micro_batch, start, end)
            for j, action, start, end in _run_order(schedule, costs)]


def bubble_fraction(p: int, m: int) -> float:
    """Idle share of a GPipe or 1F1B pipeline with equal stage costs: ``(p - 1) / (m + p - 1)``."""
    _check_sizes(p, m)
    return (p - 1) / (m + p - 1)
