"""Reading a pipeline's timeline (measured or simulated): activations in flight, stage costs, dispatch overheads.

Both take the events of :func:`~parallel_lib.pipeline_parallel.schedule.simulate` or of a
:class:`~parallel_lib.pipeline_parallel.Pipe`'s ``timeline``, on lanes ``"stage j"``.
"""

from __future__ import annotations

import statistics
from typing import Iterable, Optional

from parallel_lib.common.timeline import Event
from parallel_lib.pipeline_parallel.schedule import Schedule, StageCost, stage_lane

__all__ = ["in_flight", "stage_costs_from_events", "dispatch_overheads"]


def in_flight(events: Iterable[Event], time: float) -> list[int]:
    """Micro-batches whose activations each stage holds at ``time``: forward begun, backward not done.

    This is the activation memory of a schedule in units of one micro-batch's
    activations per stage: GPipe climbs to m, 1F1B stays at most p. With a split backward
    the weight-gradient event (label "W") releases them; a rank holding several model stages
    (label "s<stage>") counts each stage's micro-batch once.
    """
    events = list(events)
    p = 1 + max((int(e.lane.split()[-1]) for e in events), default=-1)
    held = [0] * p
    split = {_key(e) for e in events if e.label.startswith("W")}
    done = {_key(e) for e in events if e.kind == "backward" and e.end <= time
            and (e.label.startswith("W") or _key(e) not in split)}
    for e in events:
        if e.kind == "forward" and e.start < time and _key(e) not in done:
            held[int(e.lane.split()[-1])] += 1
    return held


def _key(e: Event) -> tuple[str, Optional[int], str]:
    """(lane, micro-batch, model stage label) of an event: what one activation belongs to."""
    return e.lane, e.micro_batch, e.label.split()[-1] if e.label.split() and e.label.split()[-1][:1] == "s" else ""


def stage_costs_from_events(events: Iterable[Event], p: int) -> list[StageCost]:
    """Median measured (forward, backward) duration per stage, to feed :func:`simulate`.

    Raises:
        ValueError: a stage without forward or backward events.
    """
    events = list(events)
    costs = []
    for j in range(p):
        pair = []
        for kind in ("forward", "backward"):
            durations = [e.duration for e in events if e.lane == stage_lane(j) and e.kind == kind
                         and not e.label.startswith("W")]
            if not durations:
                raise ValueError(f"no {kind} events on lane {stage_lane(j)!r}; pass a training step's timeline")
            pair.append(statistics.median(durations))
        costs.append((pair[0], pair[1]))
    return costs


def dispatch_overheads(events: Iterable[Event], schedule: Schedule) -> tuple[float, float]:
    """``(gap, hop)``: median idle time before a rank's action that the simulator does not model.

    ``gap``: between two actions of a rank when the second one needs nothing from another rank
    (handing the next task to the rank's thread, scheduling it); ``hop``: from the end of another
    rank's action to the start of the one waiting for its output, when that output came after the
    rank's previous action ended (the message, and the same hand-over). On a simulated timeline
    they are 0 and ``comm``.
    Medians, so a few long stalls of a loaded machine do not count. Feeding them to the simulator
    (each action ``gap`` longer, ``comm = hop - gap``) compares a measured bubble with one that
    has the same per-action overheads.
    """
    events = list(events)
    n, place = schedule.num_model_stages, schedule.placement

    def key(e: Event) -> tuple[str, int, int]:
        words = e.label.split()
        stage = int(words[-1][1:]) if words and words[-1][:1] == "s" else int(e.lane.split()[-1])
        return ("W" if words[:1] == ["W"] else "F" if e.kind == "forward" else "B"), stage, e.micro_batch

    ends = {key(e): e.end for e in events}
    gaps, hops = [], []
    for j in range(schedule.num_stages):
        lane = sorted((e for e in events if e.lane == stage_lane(j)), key=lambda e: e.start)
        for before, e in zip(lane, lane[1:]):
            kind, s, i = key(e)
            dep = ("F", s - 1, i) if kind == "F" and s > 0 else ("B", s + 1, i) if kind == "B" and s + 1 < n else None
            if dep is None or place[dep[1]] == j:  # every input made on this rank, before
                gaps.append(e.start - before.end)
            elif dep in ends and ends[dep] >= before.end:  # the other rank's output came last
                hops.append(e.start - ends[dep])
            # else: the message arrived while the rank was busy: how long it took is not seen
    return (statistics.median(gaps) if gaps else 0.0), (statistics.median(hops) if hops else 0.0)
