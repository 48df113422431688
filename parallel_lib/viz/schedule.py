"""Pipeline schedules drawn tick by tick: the animation of chapter 04 and its still frames.

Every picture here is :func:`parallel_lib.pipeline_parallel.simulate` of a schedule object
from :mod:`parallel_lib.pipeline_parallel.schedule`, the same objects :class:`~parallel_lib.pipeline_parallel.Pipe`
executes, so the animation cannot show a schedule other than the one that runs.
:func:`render_schedule` is a pure function (schedule, tick) -> figure: the widget
calls it on every tick, and :func:`figures` calls it for the static images.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from parallel_lib.common.timeline import Event, busy_time, makespan
from parallel_lib.pipeline_parallel.schedule import (
    Schedule,
    StageCost,
    bubble_fraction,
    make_schedule,
    simulate,
    stage_lane,
)
from parallel_lib.pipeline_parallel.timeline_stats import in_flight
from parallel_lib.viz.timeline import KIND_COLORS

__all__ = ["bubble_until", "render_schedule", "render_schedules", "schedule_widget", "event_colour", "WIDGET_SCHEDULES"]

Costs = Union[StageCost, Sequence[StageCost]]
W_COLOUR = "#8172B3"  # the weight gradient of a split backward
# a rank's second model stage (interleaved, V): the same colours, lighter
SECOND_STAGE = {"forward": "#9DB4DA", "backward": "#EDB896", "W": "#B8AED6"}
WIDGET_SCHEDULES = [("GPipe", "gpipe"), ("1F1B", "1f1b"), ("interleaved", "interleaved"), ("ZB-H1", "zb-h1"),
                    ("ZB-H2", "zb-h2"), ("ZBV", "zbv"), ("DualPipeV", "dualpipev")]
_CH04 = ("gpipe", "1f1b")  # the schedules chapter 04's formula (p−1)/(m+p−1) is about


def event_colour(e: Event, p: int) -> str:
    """F blue, B orange, W purple; lighter on a rank's second model stage (label "s<stage>", stage >= p)."""
    words = e.label.split()
    second = bool(words) and words[-1][:1] == "s" and int(words[-1][1:]) >= p
    key = "W" if words[:1] == ["W"] else e.kind
    if second:
        return SECOND_STAGE[key]
    return W_COLOUR if key == "W" else KIND_COLORS[e.kind]


def bubble_until(events: Sequence[Event], tick: float, p: int) -> float:
    """Idle share of the p stages' time from 0 to ``tick`` (0 at tick 0)."""
    if tick <= 0:
        return 0.0
    clipped = [Event(e.lane, e.kind, e.micro_batch, e.start, min(e.end, tick)) for e in events if e.start < tick]
    return 1.0 - sum(busy_time(clipped, stage_lane(j)) for j in range(p)) / (p * tick)


def render_schedule(schedule: Schedule, tick: Optional[float] = None, stage_costs: Costs = (1.0, 1.0),
                    ax: Optional[Axes] = None, title: Optional[str] = None) -> Figure:
    """Draw a schedule's simulated timeline as it stands at clock ``tick``.

    Work done by ``tick`` is filled (forward and backward in their colours, the
    micro-batch number on each cell), work still to come is a faint outline, and
    each stage's label says how many micro-batches' activations it holds at that
    moment. The title carries the bubble so far and at the end.

    Args:
        schedule: the schedule to draw.
        tick: the moment to show; None shows the finished run.
        stage_costs: ``(forward, backward)`` per stage or for all, as for ``simulate``.
        ax: axes to draw into; a new figure when None.
        title: heading; default names the schedule, p and m.

    Returns:
        The figure holding the axes.
    """
    events = simulate(schedule, stage_costs)
    p, total = schedule.num_stages, makespan(events)
    now = total if tick is None else min(max(tick, 0.0), total)
    if ax is None:
        _, ax = plt.subplots(figsize=(max(6.0, 0.45 * total + 2.0), 0.55 * p + 1.5))
    for e in events:
        row = int(e.lane.split()[-1])
        colour = event_colour(e, p)
        ax.add_patch(Rectangle((e.start, row), e.duration, 0.9, facecolor="none", edgecolor=colour, alpha=0.3))
        if e.start < now:
            width = min(e.end, now) - e.start
            ax.add_patch(Rectangle((e.start, row), width, 0.9, facecolor=colour, edgecolor="white"))
            ax.text(e.start + width / 2, row + 0.45, str(e.micro_batch), ha="center", va="center",
                    fontsize=8, color="white")
    held = in_flight(events, now)
    ax.axvline(now, color="black", linewidth=1)
    ax.set_xlim(0, total + 0.5)
    ax.set_ylim(p, 0)
    ax.set_yticks([j + 0.45 for j in range(p)], [f"{stage_lane(j)} · holds {held[j]}" for j in range(p)],
                  fontsize=8)
    ax.set_xlabel("clock tick")
    m = schedule.num_micro_batches
    end = bubble_until(events, total, p)
    if tick is None and schedule.name in _CH04:
        stats = f"bubble {end:.0%} (formula (p−1)/(m+p−1) = {bubble_fraction(p, m):.0%})"
    elif tick is None:
        stats = f"idle share {end:.0%} of the step"
    else:
        stats = f"tick {now:g}/{total:g} · bubble so far {bubble_until(events, now, p):.0%}, at the end {end:.0%}"
    ax.set_title(f"{title or f'{schedule.name}: p={p} stages, m={m} micro-batches'}\n{stats}", fontsize=9)
    handles = [Patch(color=KIND_COLORS[k], label=k) for k in ("forward", "backward")]
    if schedule.split_backward:
        handles[1] = Patch(color=KIND_COLORS["backward"], label="B (input gradient)")
        handles.append(Patch(color=W_COLOUR, label="W (weight gradient)"))
    if schedule.virtual > 1:
        handles.append(Patch(color=SECOND_STAGE["forward"], label="second stage of a rank"))
    ax.legend(handles=handles, loc="lower right", fontsize=7)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.figure.tight_layout()
    return ax.figure


def _costs(backward_cost: float) -> StageCost:
    return (1.0, float(backward_cost))


def schedule_widget(schedule: str = "gpipe", stages: int = 4, micro_batches: int = 6,
                    backward_cost: float = 1.0) -> Any:
    """The animation: Play and a tick slider, with schedule, stages, micro-batches and backward cost.

    Returns:
        An ``ipywidgets.VBox`` to display as a cell's last expression. Its
        ``children[-2]`` is the HTML line with the live bubble fraction.
    """
    import ipywidgets as w  # imported here: the library itself runs without a notebook
    from IPython.display import display

    style = {"description_width": "initial"}
    pick = w.ToggleButtons(options=WIDGET_SCHEDULES, value=schedule, description="schedule")
    p = w.IntSlider(value=stages, min=1, max=8, description="stages", style=style)
    m = w.IntSlider(value=micro_batches, min=1, max=16, description="micro-batches", style=style)
    cost = w.Dropdown(options=[("backward = forward", 1.0), ("backward = 2 × forward", 2.0)],
                      value=backward_cost, description="cost", style=style)
    play = w.Play(value=0, min=0, step=1, interval=600, description="play")
    tick = w.IntSlider(value=0, min=0, description="tick", style=style)
    w.jslink((play, "value"), (tick, "value"))  # the Play button drives the slider in the browser
    status = w.HTML()
    output = w.Output()

    def redraw(_: Any = None) -> None:
        try:
            chosen = make_schedule(pick.value, p.value, m.value)
        except ValueError as error:  # interleaved needs m a multiple of p: say so instead of drawing
            status.value = f"<b>{pick.label}</b>: {error}"
            return
        total = int(makespan(simulate(chosen, _costs(cost.value))))
        play.max = tick.max = total
        events = simulate(chosen, _costs(cost.value))
        status.value = (f"<b>{pick.label}</b>, tick {tick.value}/{total}: bubble so far "
                        f"{bubble_until(events, tick.value, p.value):.0%}, at the end "
                        f"{bubble_until(events, total, p.value):.0%}; activations held per stage now: "
                        f"{in_flight(events, tick.value)}")
        with output:
            output.clear_output(wait=True)
            fig = render_schedule(chosen, tick.value, _costs(cost.value))
            display(fig)
            plt.close(fig)  # one figure per frame, not one more each time the slider moves

    for control in (pick, p, m, cost, tick):
        control.observe(redraw, names="value")
    redraw()
    return w.VBox([w.HBox([pick, cost]), w.HBox([p, m]), w.HBox([play, tick]), status, output])


def render_schedules(schedules: Sequence[Schedule], stage_costs: Costs = (1.0, 2.0),
                     fractions: Sequence[float] = (), title: str = "backward = 2 × forward") -> Figure:
    """Each schedule finished (one row each), or frame by frame at ``fractions`` of GPipe's step time."""
    if not fractions:
        fig, axes = plt.subplots(len(schedules), 1, figsize=(12, 3 * len(schedules)), squeeze=False)
        for schedule, ax in zip(schedules, axes[:, 0]):
            render_schedule(schedule, None, stage_costs, ax=ax, title=f"{schedule.name} ({title})")
        fig.tight_layout()
        return fig
    total = makespan(simulate(schedules[0], stage_costs))
    ticks = [round(total * f) for f in fractions]
    fig, grid = plt.subplots(len(schedules), len(ticks), figsize=(5.5 * len(ticks), 3.25 * len(schedules)),
                             squeeze=False)
    for row, schedule in enumerate(schedules):
        for col, tick in enumerate(ticks):
            render_schedule(schedule, tick, stage_costs, ax=grid[row][col], title=schedule.name)
    fig.suptitle("The pipeline animation, frame by frame (Play in notebook 04 to run it)")
    fig.tight_layout()
    return fig
