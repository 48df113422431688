"""Reading a pipeline's timeline (measured or simulated): activations in flight, stage costs.

Both take the events of :func:`~parallel_lib.pipeline_parallel.schedule.simulate` or of a
:class:`~parallel_lib.pipeline_parallel.Pipe`'s ``timeline``, on lanes ``"stage j"``.
"""

from __future__ import annotations

import statistics
from typing import Iterable, Optional

from parallel_lib.common.timeline import Event
from parallel_lib.pipeline_parallel.schedule import StageCost, stage_lane

__all__ = ["in_flight", "stage_costs_from_events"]


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
