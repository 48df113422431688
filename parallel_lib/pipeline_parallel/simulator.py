"""Check a schedule and replay it with costs: the validator and the simulator of every schedule.

:func:`validate_schedule` checks the rules every schedule must meet before anything runs;
:func:`replay` runs the per-rank lists as a list scheduler (each action starts when its rank is
free and its inputs have arrived) and :func:`simulate_schedule` reads the numbers off the result:
step time, bubble and peak activation memory per rank.

Bubble convention (chapter 08). ``bubble = max over ranks of (span_r - busy_r) / busy_r``: the
idle time inside a rank's own span of work (first start to last end) relative to its work, i.e.
relative to the ideal step time ``m·(F+B+W)``. For GPipe and 1F1B with equal costs that is
``(p-1)/m``; chapter 04's ``(p-1)/(m+p-1)`` is the same idle time as a share of the whole step,
``b / (1 + b)``. ``sync_bubble = (step - ideal) / ideal`` is the one-step figure when every rank
waits for the optimizer step; it differs only for schedules whose ranks start and end at
different times (ZB-H2's parallelogram), whose idle ends vanish when steps overlap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from parallel_lib.common.checks import check_number, positive_int
from parallel_lib.common.timeline import Event
from parallel_lib.pipeline_parallel.schedule import Action, Schedule, action_ready, stage_lane

__all__ = ["Costs", "SimResult", "validate_schedule", "replay", "simulate", "simulate_schedule", "per_stage_costs", "peak_in_flight",
           "bubbles", "measured_costs"]

Cost = tuple[float, ...]  # (F, B) with B the whole backward, or (F, B, W)
Costs = Union[Cost, Sequence[Cost]]


def _key(schedule: Schedule, rank: int, action: Action) -> tuple[str, int, int]:
    return action.kind, schedule.stage_of(rank, action), action.micro_batch


def validate_schedule(schedule: Schedule, require_backward: bool = True) -> None:
    """Check that a schedule can run and computes every gradient exactly once.

    Rules: every model stage lives on one rank (``placement``) and that rank runs its ``F(i)``
    (and ``B(i)`` when ``require_backward``, and ``W(i)`` when the backward is split) exactly
    once for every micro-batch; on a rank ``F`` comes before ``B`` before ``W`` of the same
    micro-batch and stage; ``F(i, s)`` needs ``F(i, s-1)`` and ``B(i, s)`` needs ``B(i, s+1)``,
    and the per-rank orders must allow all of that without a deadlock.

    Raises:
        ValueError: no rank or no micro-batch, or naming the rank and the action that breaks a rule.
    """
    positive_int("num_stages", schedule.num_stages)  # a schedule of nothing would pass every rule below
    positive_int("num_micro_batches", schedule.num_micro_batches)
    p, m = schedule.num_stages, schedule.num_micro_batches
    if len(schedule.stages) != p:
        raise ValueError(f"schedule has {len(schedule.stages)} stage lists for num_stages={p}")
    if sorted(set(schedule.placement)) != list(range(p)):
        raise ValueError(f"placement must put model stages on every rank 0..{p - 1} and nowhere else, "
                         f"got placement={schedule.placement}")
    kinds = ("F", "B", "W") if schedule.split_backward else ("F", "B")
    kinds = kinds if require_backward else ("F",)
    for j, actions in enumerate(schedule.stages):
        mine = [s for s, rank in enumerate(schedule.placement) if rank == j]
        one_per_rank = mine == [j] and all(a.stage is None for a in actions)
        expected = sorted((kind, s, i) for kind in kinds for s in mine for i in range(m))
        if sorted(_key(schedule, j, a) for a in actions) != expected:
            wanted = " ".join(str(Action(kind, i, None if one_per_rank else s)) for kind, s, i in expected)
            raise ValueError(f"stage {j} must run each of {wanted} once, got {' '.join(map(str, actions))}")
        seen: set[tuple[str, int, int]] = set()
        for action in actions:
            before = {"B": "F", "W": "B"}.get(action.kind)
            if before and (before, *_key(schedule, j, action)[1:]) not in seen:
                raise ValueError(f"stage {j} runs {action} before {before}{str(action)[1:]}")
            seen.add(_key(schedule, j, action))
    replay(schedule, (1.0, 1.0, 1.0) if schedule.split_backward else (1.0, 1.0))


def per_stage_costs(schedule: Schedule, costs: Costs) -> list[tuple[float, float, float]]:
    """``(F, B, W)`` per model stage from what :func:`simulate` accepts.

    One cost (a pair or a triple) is the cost of one rank's share of the model, so each of a
    rank's v stages costs 1/v of it; a list gives one cost per model stage. A pair ``(F, B)``
    has B the whole backward: a split backward runs it as B = W = B/2. A triple run unsplit
    costs B + W for its backward.
    """
    n, v = schedule.num_model_stages, schedule.virtual
    example = "e.g. stage_costs=(1.0, 2.0) for a forward of 1 and a backward of 2 time units"
    if not isinstance(costs, (tuple, list)) or not costs:
        raise TypeError(f"stage_costs must be one (forward, backward[, weight]) tuple of numbers or a list of "
                        f"{n} of them (one per model stage), got {costs!r} ({type(costs).__name__}); {example}")
    single = not any(isinstance(c, (tuple, list)) for c in costs)
    for x in (costs if single else [x for c in costs if isinstance(c, (tuple, list)) for x in c]):
        if not isinstance(x, (int, float)) or isinstance(x, bool):
            raise TypeError(f"stage_costs must hold numbers (times), got {x!r} ({type(x).__name__}) in "
                            f"stage_costs={costs!r}; {example}")
    items = [tuple(x / v for x in costs)] * n if single else [tuple(c) for c in costs]  # type: ignore[union-attr]
    ok = len(items) == n and all(len(c) in (2, 3) and all(isinstance(x, (int, float)) and math.isfinite(x)
                                                          and x >= 0 for x in c) for c in items)
    if not ok:
        raise ValueError(f"stage_costs must be one (forward, backward[, weight]) cost of finite, non-negative "
                         f"numbers or {n} of them (one per model stage), got stage_costs={costs!r}")
    if not any(x > 0 for c in items for x in c):
        raise ValueError(f"stage_costs are all zero ({costs!r}): every action would take no time, so the timeline "
                         f"has no step time and no bubble to measure; give positive costs, {example}")
    return [(c[0], c[1] / 2, c[1] / 2) if len(c) == 2 else (c[0], c[1], c[2]) for c in items]  # type: ignore


def replay(schedule: Schedule, costs: Costs = (1.0, 1.0), comm: float = 0.0, cores: Optional[int] = None
           ) -> list[tuple[int, Action, float, float]]:
    """List-schedule the actions: each starts when its rank is free and its inputs have arrived.

    A tensor between model stages on different ranks arrives ``comm`` after it was made.
    ``cores``: how many ranks can compute at once (None: every rank has a device of its own).
    With fewer cores than busy ranks the busy ranks share them equally, as an operating system
    time-slices processes, each action running at ``cores / busy ranks`` of its speed (see
    :func:`_replay_shared`); a rank waiting for a message uses no core.

    Returns:
        ``(rank, action, start, end)`` in completion order.

    Raises:
        ValueError: a deadlock: every rank waits for an action that can never run before it, or
            ``cores`` below 1.
    """
    per_stage = per_stage_costs(schedule, costs)
    check_number("comm", comm, 0.0)
    if cores is not None:
        positive_int("cores", cores)
        return _replay_shared(schedule, per_stage, comm, cores)
    p = schedule.num_stages
    position, rank_free = [0] * p, [0.0] * p
    finished: dict[tuple[str, int, int], float] = {}
    order: list[tuple[int, Action, float, float]] = []
    total = sum(len(actions) for actions in schedule.stages)
    while len(order) < total:
        candidates = []
        for j in range(p):
            if position[j] == len(schedule.stages[j]):
                continue
            action = schedule.stages[j][position[j]]
            if not action_ready(schedule, j, action, finished):
                continue
            candidates.append((max(rank_free[j], _input_arrival(schedule, j, action, finished, comm)), j, action))
        if not candidates:
            raise _deadlock(schedule, position)
        start, j, action = min(candidates, key=lambda c: (c[0], c[1]))
        end = start + _duration(schedule, per_stage, j, action)
        finished[_key(schedule, j, action)] = end
        rank_free[j] = end
        position[j] += 1
        order.append((j, action, start, end))
    return order


def _replay_shared(schedule: Schedule, per_stage: list[tuple[float, float, float]], comm: float, cores: int
                   ) -> list[tuple[int, Action, float, float]]:
    """:func:`replay` with ``cores`` shared by the busy ranks (processor sharing), event by event.

    Between two events (an action ends, a message arrives) the set of busy ranks is fixed and
    each runs at ``min(1, cores / busy)``; an action starts the moment its rank is free and its
    inputs have arrived, as in :func:`replay`, and ends when its work is done.
    """
    p = schedule.num_stages
    position = [0] * p
    finished: dict[tuple[str, int, int], float] = {}
    running: dict[int, list] = {}  # rank -> [action, work left, start]
    order: list[tuple[int, Action, float, float]] = []
    total = sum(len(actions) for actions in schedule.stages)
    tolerance = 1e-12 * max(1.0, sum(sum(c) for c in per_stage) * schedule.num_micro_batches)
    now = 0.0
    while len(order) < total:
        arrivals = []  # when a waiting rank's message comes
        for j in range(p):
            if j in running or position[j] == len(schedule.stages[j]):
                continue
            action = schedule.stages[j][position[j]]
            if not action_ready(schedule, j, action, finished):
                continue
            arrive = _input_arrival(schedule, j, action, finished, comm)
            if arrive > now + tolerance:
                arrivals.append(arrive)
                continue
            running[j] = [action, _duration(schedule, per_stage, j, action), now]
        if not running:
            if not arrivals:
                raise _deadlock(schedule, position)
            now = min(arrivals)
            continue
        rate = min(1.0, cores / len(running))
        step = min([left for _, left, _ in running.values()]) / rate
        if arrivals:
            step = min(step, min(arrivals) - now)
        now += step
        for j in sorted(running):
            running[j][1] -= step * rate
            if running[j][1] <= tolerance:
                action, _, start = running.pop(j)
                finished[_key(schedule, j, action)] = now
                position[j] += 1
                order.append((j, action, start, now))
    return order


def _input_arrival(schedule: Schedule, j: int, action: Action, finished: dict[tuple[str, int, int], float],
                   comm: float) -> float:
    """When the input ``action`` on rank j waits for has arrived (0.0: it needs none from another stage):
    its neighbour stage's output, ``comm`` later if that stage lives on another rank."""
    kind, s, i = _key(schedule, j, action)
    source = s - 1 if kind == "F" else s + 1 if kind == "B" else -1
    if not 0 <= source < schedule.num_model_stages:
        return 0.0
    return finished[(kind, source, i)] + (comm if schedule.placement[source] != j else 0.0)


def _duration(schedule: Schedule, per_stage: list[tuple[float, float, float]], j: int, action: Action) -> float:
    """Seconds of ``action`` on rank j: F, B (B + W where the backward is not split) or W of its stage."""
    f, b, w = per_stage[schedule.stage_of(j, action)]
    return {"F": f, "B": b if schedule.split_backward else b + w, "W": w}[action.kind]


def _deadlock(schedule: Schedule, position: list[int]) -> ValueError:
    """The error for a replay where no rank can run its next action."""
    blocked = {f"stage {j}": str(schedule.stages[j][position[j]])
               for j in range(schedule.num_stages) if position[j] < len(schedule.stages[j])}
    return ValueError(f"schedule {schedule.name!r} deadlocks: every stage waits for an action "
                      f"that cannot run first; next actions: {blocked}")


def _label(schedule: Schedule, action: Action) -> str:
    """Event label: the model stage when a rank holds several, and W for weight gradients."""
    stage = f"s{action.stage}" if action.stage is not None and schedule.virtual > 1 else ""
    return ("W" if action.kind == "W" else "") + (" " if action.kind == "W" and stage else "") + stage


def simulate(schedule: Schedule, stage_costs: Costs = (1.0, 1.0), comm: float = 0.0,
             cores: Optional[int] = None) -> list[Event]:
    """Replay a schedule with fixed costs and return its timeline.

    Args:
        schedule: the schedule to replay (it is validated first).
        stage_costs: ``(forward, backward)`` or ``(F, B, W)`` for a rank's share of the model, or
            one per model stage (see :func:`per_stage_costs`).
        comm: time a tensor takes between two ranks.
        cores: how many ranks compute at once (None: a device per rank; fewer cores than ranks
            share them, see :func:`replay`).

    Returns:
        One :class:`Event` per action on lanes ``"stage j"`` (rank j), in completion order;
        W actions are backward events labelled "W", a stage of a multi-stage rank is in the label.

    Raises:
        TypeError: costs that are not a tuple (or list) of numbers, or a list of such tuples.
        ValueError: an invalid schedule, badly shaped costs, a cost that is negative, NaN or infinite,
            or costs that are all zero.
    """
    checked = per_stage_costs(schedule, stage_costs)  # shape errors before validation
    validate_schedule(schedule, require_backward=any(a.kind == "B" for a in schedule.stages[0]))
    return [Event(stage_lane(j), action.event_kind, action.micro_batch, start, end, _label(schedule, action))
            for j, action, start, end in replay(schedule, checked, comm, cores)]


@dataclass(frozen=True)
class SimResult:
    """What :func:`simulate_schedule` reads off a replay.

    Attributes:
        events: the timeline.
        step_time: first start to last end over all ranks.
        busy: work per rank.
        bubble: max over ranks of idle inside its own span / its work (see the module docstring).
        sync_bubble: ``(step_time - max busy) / max busy``.
        peak_in_flight: per rank, the most micro-batch activations held at once, in units of one
            micro-batch through one rank's share of the model (a stage of an interleaved rank counts 1/v).
        peak_bytes: ``peak_in_flight`` times ``activation_bytes``, per rank.
    """

    events: list[Event]
    step_time: float
    busy: list[float]
    bubble: float
    sync_bubble: float
    peak_in_flight: list[float]
    peak_bytes: list[float]


def peak_in_flight(schedule: Schedule) -> list[float]:
    """Per rank, the most activations its list holds at once (F taken, released by W, or B when unsplit)."""
    release = "W" if schedule.split_backward else "B"
    peaks = []
    for actions in schedule.stages:
        live = peak = 0.0
        for a in actions:
            live += 1.0 / schedule.virtual if a.kind == "F" else -1.0 / schedule.virtual if a.kind == release else 0
            peak = max(peak, live)
        peaks.append(round(peak, 9))
    return peaks


def simulate_schedule(schedule: Schedule, stage_costs: Costs = (1.0, 1.0), comm: float = 0.0,
                      activation_bytes: Optional[float] = None, cores: Optional[int] = None) -> SimResult:
    """Replay ``schedule`` and report step time, bubble and peak activation memory per rank.

    Args:
        activation_bytes: bytes one micro-batch's activations take on one rank's share of the model.
        cores: how many ranks compute at once (None: a device per rank; see :func:`replay`).
    """
    events = simulate(schedule, stage_costs, comm, cores)
    step, busy, bubble, sync_bubble = bubbles(events, schedule.num_stages)
    peaks = peak_in_flight(schedule)
    per_mb = 0.0 if activation_bytes is None else float(activation_bytes)
    return SimResult(events, step, busy, bubble, sync_bubble, peaks, [x * per_mb for x in peaks])


def bubbles(events: Sequence[Event], p: int) -> tuple[float, list[float], float, float]:
    """``(step time, busy per rank, bubble, sync_bubble)`` of a timeline, measured or simulated (module docstring)."""
    lanes = [[e for e in events if e.lane == stage_lane(j)] for j in range(p)]
    busy = [sum(e.duration for e in lane) for lane in lanes]
    spans = [max(e.end for e in lane) - min(e.start for e in lane) if lane else 0.0 for lane in lanes]
    step = max(e.end for e in events) - min(e.start for e in events)
    bubble = max((span - work) / work for span, work in zip(spans, busy) if work > 0)
    return step, busy, bubble, (step - max(busy)) / max(busy)


def measured_costs(events: Sequence[Event], schedule: Schedule) -> list[tuple[float, float, float]]:
    """Median measured ``(F, B, W)`` per model stage from a run of ``schedule``, to feed :func:`simulate`.

    An unsplit run's backward is reported as B with W = 0 (its B runs both).
    """
    import statistics
    place = schedule.placement
    costs = []
    for s in range(len(place)):
        tag = f"s{s}" if schedule.virtual > 1 else ""
        mine = [e for e in events if e.lane == stage_lane(place[s]) and e.label.split()[-1:] == ([tag] if tag else [])
                or (e.lane == stage_lane(place[s]) and not tag and e.label == "W")]
        triple = []
        for kind, w in (("forward", False), ("backward", False), ("backward", True)):
            durations = [e.duration for e in mine if e.kind == kind and e.label.startswith("W") == w]
            triple.append(statistics.median(durations) if durations else 0.0)
        costs.append((triple[0], triple[1], triple[2]))
    return costs
