"""A Gantt chart of :class:`parallel_lib.common.timeline.Event` lists.

Used for measured model-parallel timelines (ch. 03), measured and simulated
pipeline timelines (ch. 04) and data-parallel ranks; one function so that a
measured and a simulated run look alike and can be compared bar by bar.
"""

from __future__ import annotations

from typing import Optional, Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from parallel_lib.common.timeline import Event, idle_fraction
from parallel_lib.common.timeline import lanes as lanes_of

__all__ = ["KIND_COLORS", "plot_timeline"]

KIND_COLORS = {"forward": "#4C72B0", "backward": "#DD8452", "comm": "#55A868", "prefill": "#8172B3",
               "decode": "#64B5CD"}


def plot_timeline(
    events: Sequence[Event],
    ax: Optional[Axes] = None,
    title: Optional[str] = None,
    lanes: Optional[Sequence[str]] = None,
    unit: str = "ms",
    show_bubble: bool = True,
) -> Figure:
    """Draw one row per lane and one bar per event, coloured by kind.

    Args:
        events: the events to draw; times are shifted so the first starts at 0.
        ax: axes to draw into; a new figure is made when None.
        title: axes title; the idle fraction is appended when ``show_bubble``.
        lanes: row order (top to bottom); default: order of first appearance.
        unit: "ms", "s" or "ticks" (simulated schedules in unit-cost ticks).
        show_bubble: append the measured idle fraction to the title.

    Returns:
        The matplotlib figure holding the axes.
    """
    scale = {"ms": 1e3, "s": 1.0, "ticks": 1.0}
    if unit not in scale:
        raise ValueError(f"unit must be one of {sorted(scale)}, got unit={unit!r}")
    if ax is None:
        rows = len(lanes or lanes_of(events)) or 1
        _, ax = plt.subplots(figsize=(10, 0.6 * rows + 1.2))
    fig = ax.figure
    order = list(lanes) if lanes is not None else lanes_of(events)
    t0 = min((e.start for e in events), default=0.0)
    for e in events:
        y = order.index(e.lane)
        left, width = (e.start - t0) * scale[unit], e.duration * scale[unit]
        ax.barh(y, width, left=left, height=0.8, color=KIND_COLORS[e.kind], edgecolor="white", linewidth=0.5)
        text = e.label or ("" if e.micro_batch is None else str(e.micro_batch))
        if text:
            ax.text(left + width / 2, y, text, ha="center", va="center", fontsize=8, color="white")
    ax.set_yticks(range(len(order)), order)
    ax.invert_yaxis()
    ax.set_xlabel({"ms": "time (ms)", "s": "time (s)", "ticks": "clock tick"}[unit])
    kinds = [k for k in KIND_COLORS if any(e.kind == k for e in events)]
    ax.legend(handles=[Patch(color=KIND_COLORS[k], label=k) for k in kinds], loc="upper right", fontsize=8)
    heading = title or ""
    if show_bubble and events:
        heading = f"{heading}  (idle {idle_fraction(events):.0%})".strip()
    ax.set_title(heading)
    fig.tight_layout()
    return fig
