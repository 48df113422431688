"""Ring attention drawn step by step, replayed from the step record the ranks wrote while they ran it.

Every frame is one step of :func:`parallel_lib.context_parallel.ring.ring_attention` as the
ranks recorded it (one :class:`~parallel_lib.context_parallel.ring.RingEvent` per rank and
step, ``record=``): which key/value block each rank held, what its one ``batch_isend_irecv``
sent to the right-hand neighbour, and how many tiles of attention it computed on the block. So
the picture shows what the code did, not what it was meant to do: under a causal mask and the
contiguous split, the first ranks' blocks from the future are drawn greyed (no tile computed),
which is the load imbalance of chapter 11's section 4.

:func:`render_ring_attention` is a pure function (events, direction, step) -> figure; the widget
calls it on every frame, :func:`render_ring_attention_strip` draws the forward steps of several
runs side by side for the static image (``figures/ring_attention.png``).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from parallel_lib.common.checks import check_choice
from parallel_lib.context_parallel.ring import RingEvent
from parallel_lib.viz.ring import rank_color

__all__ = ["as_events", "gathered_record", "ring_attention_caption", "render_ring_attention",
           "render_ring_attention_strip",
           "ring_attention_widget"]

DIRECTIONS = ("forward", "backward")
_BOX = 0.36  # one block's square, in axes units (the ring has radius 1)


def as_events(record: Sequence[Any]) -> list[RingEvent]:
    """The record as :class:`RingEvent` objects: a launch returns them as dicts (``dataclasses.asdict``).

    Raises:
        ValueError: an empty record, or one whose ranks' steps do not form a whole run.
    """
    events = [e if isinstance(e, RingEvent) else RingEvent(**{**e, "sends": tuple(e["sends"])}) for e in record]
    if not events:
        raise ValueError("record must hold the RingEvents of a run (ring_attention(..., record=[])), got none")
    cp = 1 + max(max(e.rank, e.step if e.direction == "forward" else 0) for e in events)
    forward = {(e.step, e.rank) for e in events if e.direction == "forward"}
    if forward != {(t, r) for t in range(cp) for r in range(cp)}:
        raise ValueError(f"record must hold every rank's forward steps 0..{cp - 1} (cp = {cp}, from the ranks and "
                         f"steps seen); got {len(forward)} forward events: concatenate every rank's record of one run")
    return events


def gathered_record(ranks: Sequence[Sequence[Mapping[str, Any]]], index: int) -> list[RingEvent]:
    """One run's record from every rank's findings of :func:`~parallel_lib.context_parallel.verify.attention_check`.

    Args:
        ranks: what the launch returned, one list of case results (dicts) per rank.
        index: the case's position in the list of cases.

    Raises:
        ValueError: the case is not a ring-attention case (only the ring writes a record).
    """
    found = [per_rank[index] for per_rank in ranks]
    if found[0]["case"]["method"] != "ring":
        raise ValueError(f"case {index} ran {found[0]['case']['method']!r}: only ring attention writes a step record")
    return as_events([event for result in found for event in result["record"]])


def _steps(events: Sequence[RingEvent], direction: str) -> int:
    return 1 + max((e.step for e in events if e.direction == direction), default=-1)


def _at(events: Sequence[RingEvent], direction: str, step: int) -> dict[int, RingEvent]:
    return {e.rank: e for e in events if e.direction == direction and e.step == step}


def ring_attention_caption(events: Sequence[Any], direction: str, step: int) -> str:
    """One sentence on what step ``step`` of ``direction`` does."""
    events = as_events(events)
    cp = 1 + max(e.rank for e in events)
    at = _at(events, direction, step)
    tiles = sum(e.tiles for e in at.values())
    if direction == "backward" and step == cp:
        return (f"backward step {step} of {cp}: no compute; each block's dK/dV accumulator, summed over all "
                f"{cp} ranks' queries, takes its last hop home to the block's owner")
    sends = sorted({s for e in at.values() for s in e.sends})
    what = {"kv": "its key/value block", "dkv": "the dK/dV accumulator of the block it held a step before"}
    moving = " and ".join(what[s] for s in sends) if sends else "nothing (the last block is in hand)"
    verb = "attends" if direction == "forward" else "recomputes the tiles and adds its dQ, dK, dV"
    return (f"{direction} step {step}: every rank {verb} on the block in hand ({tiles} tiles over all ranks) "
            f"while sending {moving} to rank r+1")


def _xy(rank: int, cp: int) -> tuple[float, float]:
    angle = math.pi / 2 - 2 * math.pi * rank / cp  # rank 0 on top, then clockwise
    return math.cos(angle), math.sin(angle)


def render_ring_attention(events: Sequence[Any], direction: str = "forward", step: int = 0,
                          ax: Optional[Axes] = None, title: Optional[str] = None) -> Figure:
    """Draw step ``step`` of ``direction`` of one ring-attention run, from its step record.

    Each rank shows its own queries (``Q r``, its colour) beside the key/value block in hand
    (``KV b``, the owner's colour; grey and crossed out when the causal mask left no tile of it
    to compute), the tiles it computed, and arrows to the right-hand neighbour for what its one
    ``batch_isend_irecv`` of the step sent.

    Args:
        events: every rank's :class:`RingEvent` of one run (or their dicts).
        direction: "forward" or "backward".
        step: 0 .. cp - 1 (backward: .. cp, the dK/dV accumulators' last hop).
        ax: axes to draw into; a new figure when None.
        title: heading; default :func:`ring_attention_caption`.

    Raises:
        ValueError: an unknown direction, a step the record does not hold, a bad record.
    """
    events = as_events(events)
    check_choice("direction", direction, DIRECTIONS)
    cp, steps = 1 + max(e.rank for e in events), _steps(events, direction)
    if not 0 <= step < steps:
        raise ValueError(f"step must be in 0..{steps - 1} for the {direction} pass of this record (cp = {cp}), "
                         f"got step={step}")
    at = _at(events, direction, step)
    done = {r: sum(e.tiles for e in events if e.direction == direction and e.rank == r and e.step <= step)
            for r in range(cp)}
    if ax is None:
        _, ax = plt.subplots(figsize=(6.0, 5.6))
    radius = 1.0 if cp <= 2 else 1.4
    for r in range(cp):
        ux, uy = _xy(r, cp)
        x, y = radius * ux, radius * uy
        event = at.get(r)
        ax.add_patch(Rectangle((x - _BOX - 0.02, y - _BOX / 2), _BOX, _BOX, facecolor=rank_color(r), alpha=0.85))
        ax.text(x - _BOX / 2 - 0.02, y, f"Q{r}", ha="center", va="center", fontsize=10, color="white",
                fontweight="bold")
        if event is not None and not (direction == "backward" and step == cp):
            skipped = event.tiles == 0
            ax.add_patch(Rectangle((x + 0.02, y - _BOX / 2), _BOX, _BOX,
                                   facecolor="#D0D0D0" if skipped else rank_color(event.block),
                                   alpha=0.85, hatch="//" if skipped else None, edgecolor="black", linewidth=0.8))
            ax.text(x + _BOX / 2 + 0.02, y, f"KV{event.block}", ha="center", va="center", fontsize=10,
                    color="black" if skipped else "white", fontweight="bold")
            label = "skipped: all future" if skipped else f"{event.tiles} tiles"
            ax.text(x, y - _BOX / 2 - 0.04, f"{label}\n{done[r]} so far", ha="center", va="top", fontsize=8)
        ax.text(x, y + _BOX / 2 + 0.04, f"rank {r}", ha="center", va="bottom", fontsize=9, fontweight="bold",
                color=rank_color(r))
        if event is not None and event.sends and cp > 1:
            (x0, y0), (x1, y1) = [(0.45 * radius * a, 0.45 * radius * b) for a, b in (_xy(r, cp), _xy(r + 1, cp))]
            words = []
            if "kv" in event.sends:
                words.append(f"KV{event.block}")
            if "dkv" in event.sends:  # the accumulator of the block held one step before
                owner = event.block if step == cp else (event.block + 1) % cp
                words.append(f"dK,dV of {owner}")
            rad = -0.35 if cp > 2 else -0.6  # two ranks: the two arrows bow to either side
            color = "#4C72B0" if direction == "forward" else "#C44E52"
            ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), connectionstyle=f"arc3,rad={rad}", arrowstyle="-|>",
                                         mutation_scale=16, linewidth=1.6, color=color))
            mx, my = (x0 + x1) / 2 + 0.75 * rad * (y1 - y0), (y0 + y1) / 2 - 0.75 * rad * (x1 - x0)
            ax.text(mx, my, " + ".join(words), ha="center", va="center", fontsize=8,
                    bbox=dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none"))
    ax.set_xlim(-radius - 0.45, radius + 0.45)
    ax.set_ylim(-radius - 0.6, radius + 0.45)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title if title is not None else ring_attention_caption(events, direction, step), fontsize=9,
                 wrap=True)
    return ax.figure  # type: ignore[return-value]


def render_ring_attention_strip(runs: Mapping[str, Sequence[Any]], title: str = "") -> Figure:
    """The forward steps of each run in a row (one run per row): the animation on paper.

    Args:
        runs: ``{label: that run's step record}``, each run's label heading its row.
        title: the figure's heading.

    Raises:
        ValueError: no runs, or a bad record (:func:`as_events`).
    """
    if not runs:
        raise ValueError("runs must hold at least one {label: record}")
    records = {label: as_events(record) for label, record in runs.items()}
    cols = max(_steps(events, "forward") for events in records.values())
    fig, axes = plt.subplots(len(records), cols, figsize=(4.2 * cols, 4.3 * len(records)), squeeze=False)
    for row, (label, events) in zip(axes, records.items()):
        for t, ax in enumerate(row):
            if t < _steps(events, "forward"):
                render_ring_attention(events, "forward", t, ax=ax, title=f"{label}\nforward step {t}")
            else:
                ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1, 0.95 if title else 1))
    return fig


def ring_attention_widget(runs: Mapping[str, Sequence[Any]]) -> Any:
    """The animation: a run selector, forward/backward, Play and a step slider over :func:`render_ring_attention`.

    Args:
        runs: ``{label: step record}`` of one or more ring-attention runs (e.g. cp 2 and 4, both layouts).

    Returns:
        An ``ipywidgets.VBox`` to display as a cell's last expression; ``children[1]`` is the HTML
        caption of the current frame.

    Raises:
        ValueError: no runs, or a bad record.
    """
    import ipywidgets as w  # imported here: the library itself runs without a notebook
    from IPython.display import display

    if not runs:
        raise ValueError("runs must hold at least one {label: record}")
    records = {label: as_events(record) for label, record in runs.items()}
    run = w.Dropdown(options=list(records), description="run")
    direction = w.ToggleButtons(options=list(DIRECTIONS), value="forward")
    last = _steps(records[run.value], "forward") - 1
    play = w.Play(value=0, min=0, max=last, step=1, interval=1500, description="play")
    frame = w.IntSlider(value=0, min=0, max=last, description="step")
    w.jslink((play, "value"), (frame, "value"))
    caption = w.HTML()
    output = w.Output()

    def redraw(_: Any = None) -> None:
        events = records[run.value]
        caption.value = ring_attention_caption(events, direction.value, frame.value)
        with output:
            output.clear_output(wait=True)
            fig = render_ring_attention(events, direction.value, frame.value)
            display(fig)
            plt.close(fig)  # one figure per frame, not one more each time the slider moves

    def reset(_: Any) -> None:
        frame.unobserve(redraw, names="value")
        frame.value = play.value = 0
        frame.max = play.max = _steps(records[run.value], direction.value) - 1
        frame.observe(redraw, names="value")
        redraw()

    run.observe(reset, names="value")
    direction.observe(reset, names="value")
    frame.observe(redraw, names="value")
    redraw()
    return w.VBox([w.HBox([run, direction]), caption, w.HBox([play, frame]), output])
