"""Pictures of tensor parallelism (chapter 07): who holds which slice, step by step through one block.

The frames are the record of the layer code itself (:func:`parallel_lib.tensor_parallel.verify.layer_trace`,
a list of :class:`~parallel_lib.tensor_parallel.regions.RegionEvent`): each frame is one
operator as it ran, forward then backward. A frame draws, for every rank, the weights of
the layer in play (its slice coloured) and the activation before and after the operator:

- *whole*: every rank holds the same full tensor (hatched: replicated);
- *partial*: every rank holds a full-size tensor that is only its share of a sum;
- *slice*: a rank holds its 1/t of the sequence.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from parallel_lib.viz.ring import rank_color

__all__ = ["HOLDINGS", "frame_caption", "render_frame", "render_frames", "layer_widget", "render_step_times"]

# (operator, pass) -> what each rank holds (before, after)
HOLDINGS = {
    ("f", "forward"): ("whole", "whole"), ("f", "backward"): ("partial", "whole"),
    ("g", "forward"): ("partial", "whole"), ("g", "backward"): ("whole", "whole"),
    ("gather_sp", "forward"): ("slice", "whole"), ("gather_sp", "backward"): ("partial", "slice"),
    ("regather_sp", "backward"): ("slice", "whole"),
    ("reduce_scatter_sp", "forward"): ("partial", "slice"), ("reduce_scatter_sp", "backward"): ("slice", "whole"),
    ("scatter_sp", "forward"): ("whole", "slice"), ("scatter_sp", "backward"): ("slice", "whole"),
    ("gather_tp", "forward"): ("slice", "whole"), ("gather_tp", "backward"): ("whole", "slice"),
}
# the layer's weights: (name, split) — column: output features split, row: input features split
WEIGHTS = {"attention": (("c_attn: q|k|v by heads", "column"), ("c_proj", "row")),
           "mlp": (("c_fc", "column"), ("mlp_proj", "row")),
           "embedding": (("wte: vocabulary rows", "row"),), "head": (("wte (tied): vocabulary rows", "row"),)}
NAMES = {"f": "f (copy to the TP region)", "g": "g (reduce from the TP region)",
         "gather_sp": "gather from the SP region", "reduce_scatter_sp": "reduce-scatter to the SP region",
         "regather_sp": "gather the kept slice again (for the weight's gradient)",
         "scatter_sp": "scatter to the SP region", "gather_tp": "gather the output features"}


def frame_caption(events: Sequence[Any], frame: int) -> str:
    """One line on what frame ``frame`` shows."""
    e = events[frame]
    what = e.collective.replace("_", "-") if e.collective != "none" else "no communication"
    return (f"step {frame + 1}/{len(events)} — {e.label}, {e.phase}: {NAMES.get(e.op, e.op)}: {what}; "
            f"{tuple(e.shape_in)} → {tuple(e.shape_out)} on each rank")


def _tensor(ax: Axes, x: float, y: float, kind: str, rank: int, tp: int, label: str) -> None:
    w, h = 1.6, 0.7
    ax.add_patch(Rectangle((x, y), w, h, fill=False, edgecolor="grey", linewidth=0.8))
    if kind == "slice":
        ax.add_patch(Rectangle((x + rank * w / tp, y), w / tp, h, facecolor=rank_color(rank), alpha=0.8))
    elif kind == "partial":
        ax.add_patch(Rectangle((x, y), w, h, facecolor=rank_color(rank), alpha=0.3))
    else:
        ax.add_patch(Rectangle((x, y), w, h, facecolor="lightgrey", hatch="//", edgecolor="grey"))
    ax.text(x + w / 2, y - 0.2, f"{label}: {kind}", ha="center", va="top", fontsize=8)


def _weight(ax: Axes, x: float, y: float, name: str, split: str, rank: int, tp: int) -> None:
    w, h = 0.9, 0.9
    ax.add_patch(Rectangle((x, y), w, h, fill=False, edgecolor="grey", linewidth=0.8))
    if split == "column":  # my output features: a band of columns
        ax.add_patch(Rectangle((x + rank * w / tp, y), w / tp, h, facecolor=rank_color(rank), alpha=0.8))
    else:                  # my input features: a band of rows
        ax.add_patch(Rectangle((x, y + h - (rank + 1) * h / tp), w, h / tp, facecolor=rank_color(rank), alpha=0.8))
    ax.text(x + w / 2, y + h + 0.08, f"{name} ({split})", ha="center", va="bottom", fontsize=7)


def render_frame(events: Sequence[Any], frame: int, tp: int = 2, ax: Optional[Axes] = None) -> Figure:
    """One operator of the record: every rank's weights in play and its activation before → after."""
    if not 0 <= frame < len(events):
        raise ValueError(f"frame must be in 0..{len(events) - 1}, got frame={frame}")
    e = events[frame]
    before, after = HOLDINGS.get((e.op, e.phase), ("whole", "whole"))
    fig = ax.figure if ax is not None else plt.figure(figsize=(9, 1.6 + 1.5 * tp))
    ax = ax if ax is not None else fig.add_subplot()
    for rank in range(tp):
        y = (tp - 1 - rank) * 1.8
        ax.text(-0.3, y + 0.35, f"rank {rank}", ha="right", va="center", fontsize=9, color=rank_color(rank))
        for i, (name, split) in enumerate(WEIGHTS.get(e.label, ())):
            _weight(ax, 0.1 + i * 1.3, y - 0.1, name, split, rank, tp)
        _tensor(ax, 3.0, y, before, rank, tp, "before")
        ax.annotate("", xy=(6.0, y + 0.35), xytext=(4.7, y + 0.35), arrowprops=dict(arrowstyle="->"))
        ax.text(5.35, y + 0.5, e.collective.replace("_", "-") if e.collective != "none" else "local",
                ha="center", fontsize=8, weight="bold" if e.collective != "none" else "normal")
        _tensor(ax, 6.1, y, after, rank, tp, "after")
    ax.set_xlim(-1.2, 8.0)
    ax.set_ylim(-0.7, (tp - 1) * 1.8 + 1.3)
    ax.set_axis_off()
    ax.set_title(frame_caption(events, frame), fontsize=9)
    return fig


def render_frames(events: Sequence[Any], tp: int = 2, columns: int = 2) -> Figure:
    """Every frame of the record in a grid: the static picture of the widget."""
    rows = -(-len(events) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(9 * columns, (1.6 + 1.5 * tp) * rows), squeeze=False)
    for i, ax in enumerate(axes.flat):
        if i < len(events):
            render_frame(events, i, tp, ax)
        else:
            ax.set_axis_off()
    fig.tight_layout()
    return fig


def layer_widget(traces: dict[str, Sequence[Any]], tp: int = 2) -> Any:
    """Play through one block's record: a choice of record (e.g. TP, SP), Play and a step slider."""
    import ipywidgets as w
    from IPython.display import display

    which = w.Dropdown(options=list(traces), description="split")
    last = len(traces[which.value]) - 1
    play = w.Play(value=0, min=0, max=last, step=1, interval=1500, description="play")
    frame = w.IntSlider(value=0, min=0, max=last, description="step")
    w.jslink((play, "value"), (frame, "value"))
    output = w.Output()

    def redraw(_: Any = None) -> None:
        with output:
            output.clear_output(wait=True)
            fig = render_frame(traces[which.value], frame.value, tp)
            display(fig)
            plt.close(fig)

    def switch(_: Any) -> None:
        frame.value = play.value = 0
        frame.max = play.max = len(traces[which.value]) - 1
        redraw()

    which.observe(switch, names="value")
    frame.observe(redraw, names="value")
    redraw()
    return w.VBox([w.HBox([which, play, frame]), output])


def render_step_times(widths: Sequence[int], measured: dict[int, Sequence[float]],
                      predicted: dict[int, Sequence[float]], title: str = "") -> Figure:
    """Step time against model width for each tp: measured (dots) and the α–β prediction (lines)."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, tp in enumerate(sorted(measured)):
        color = plt.get_cmap("tab10")(i)
        ax.plot(widths, [t * 1e3 for t in measured[tp]], "o", color=color, label=f"tp={tp} measured")
        ax.plot(widths, [t * 1e3 for t in predicted[tp]], "-", color=color, alpha=0.6, label=f"tp={tp} predicted")
    ax.set(xscale="log", yscale="log", xlabel="width n_embd", ylabel="ms per training step", title=title)
    ax.set_xticks(list(widths), [str(w) for w in widths])
    ax.minorticks_off()
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig
