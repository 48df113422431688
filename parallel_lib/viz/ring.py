"""The ring all-reduce drawn step by step, and its measured bandwidth against the model.

Every frame is a replay of :func:`parallel_lib.data_parallel.ring.ring_steps`, the record that
:func:`~parallel_lib.data_parallel.ring.ring_all_reduce` executes, so the animation shows exactly
the messages the code sends. Each rank's buffer is a row of ``world_size`` chunks;
a chunk is striped with the colour of every rank whose data is summed into it, so a
chunk in all colours is fully reduced. :func:`render_ring` is a pure function
(world size, frame) -> figure: the widget calls it on every frame, :func:`figures`
for the still images.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from parallel_lib.data_parallel.ring import allreduce_cost, bus_bandwidth, replay_contributions, ring_steps

__all__ = ["rank_color", "frame_caption", "render_ring", "render_ring_strip", "render_bandwidth", "ring_widget"]

_CHUNK_W, _CHUNK_H = 0.26, 0.34  # one chunk's box, in axes units (the ring has radius 1)


def rank_color(rank: int) -> Any:
    return plt.get_cmap("tab10")(rank % 10)


def frame_caption(world_size: int, frame: int) -> str:
    """What frame ``frame`` shows: the start, or which step's messages just arrived."""
    steps = ring_steps(world_size, world_size)
    if frame == 0:
        return f"{world_size} ranks, each with its own data in {world_size} chunks"
    step = steps[frame - 1]
    verb = "adds it to its own" if step.phase == "reduce-scatter" else "keeps it (already summed)"
    return (f"step {frame}/{len(steps)}, {step.phase} {step.index + 1}/{world_size - 1}: every rank r sends "
            f"one chunk to rank r+1, which {verb}")


def _rank_xy(rank: int, world_size: int) -> tuple[float, float]:
    angle = math.pi / 2 - 2 * math.pi * rank / world_size  # rank 0 on top, then clockwise
    return math.cos(angle), math.sin(angle)


def _radius(world_size: int) -> float:
    """Ring radius at which neighbouring rows of ``world_size`` chunks do not overlap."""
    if world_size < 3:
        return 1.0
    return max(1.0, 0.75 * world_size * _CHUNK_W / math.sin(math.pi / world_size))


def render_ring(world_size: int, frame: int, ax: Optional[Axes] = None, title: Optional[str] = None,
                caption: bool = True) -> Figure:
    """Draw the ring after ``frame`` steps of ``ring_steps(world_size, ...)``.

    Frame 0 is the start; frame k shows the state after step k, with step k's
    messages as arrows (labelled with the chunk) and the chunks they just wrote outlined.

    Args:
        world_size: ranks in the ring, >= 1.
        frame: 0 .. 2 * (world_size - 1).
        ax: axes to draw into; a new figure when None.
        title: heading; default :func:`frame_caption`.
        caption: write the count of fully summed chunks under the ring.

    Raises:
        ValueError: ``frame`` outside 0 .. 2 * (world_size - 1).
    """
    steps = ring_steps(world_size, world_size)  # one element per chunk: chunks and ranks line up
    if not 0 <= frame <= len(steps):
        raise ValueError(f"frame must be in 0..{len(steps)} for world_size={world_size}, got frame={frame}")
    state = replay_contributions(world_size, steps[:frame])
    arrived = {(t.dst, t.chunk) for t in steps[frame - 1].transfers} if frame else set()
    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 6.0))
    n = world_size
    radius = _radius(n)
    for r in range(n):
        ux, uy = _rank_xy(r, n)
        x, y = radius * ux, radius * uy
        left = x - n * _CHUNK_W / 2
        for c in range(n):
            cx = left + c * _CHUNK_W
            owners = sorted(state[r][c])
            for k, owner in enumerate(owners):  # one stripe per rank whose data is summed in
                ax.add_patch(Rectangle((cx + k * _CHUNK_W / len(owners), y - _CHUNK_H / 2), _CHUNK_W / len(owners),
                                       _CHUNK_H, facecolor=rank_color(owner), edgecolor="none"))
            fresh = (r, c) in arrived
            ax.add_patch(Rectangle((cx, y - _CHUNK_H / 2), _CHUNK_W, _CHUNK_H, fill=False,
                                   edgecolor="black", linewidth=3.0 if fresh else 0.8))
            ax.text(cx + _CHUNK_W / 2, y - _CHUNK_H / 2 - 0.03, f"c{c}", ha="center", va="top", fontsize=8)
        ax.text(x, y + _CHUNK_H / 2 + 0.03, f"rank {r}", ha="center", va="bottom", fontsize=11,
                fontweight="bold", color=rank_color(r))
    if frame:
        step = steps[frame - 1]
        rad = -0.3
        for t in step.transfers:  # arrows run inside the ring, clear of the rows
            (x0, y0), (x1, y1) = [(0.6 * radius * a, 0.6 * radius * b)
                                  for a, b in (_rank_xy(t.src, n), _rank_xy(t.dst, n))]
            ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), connectionstyle=f"arc3,rad={rad}", arrowstyle="-|>",
                                         mutation_scale=18, linewidth=1.8,
                                         color="#C44E52" if step.phase == "reduce-scatter" else "#4C72B0"))
            # arc3 bends the curve rad/2 of the chord off its middle; 0.75 puts the label just outside
            mx, my = (x0 + x1) / 2 + 0.75 * rad * (y1 - y0), (y0 + y1) / 2 - 0.75 * rad * (x1 - x0)
            ax.text(mx, my, f"chunk {t.chunk}", ha="center", va="center", fontsize=9,
                    bbox=dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none"))
    full = sum(len(s) == n for row in state for s in row)
    if caption:
        ax.text(0, -radius - 0.75,
                f"fully summed chunk copies: {full} of {n * n}   (chunk colours = whose data it holds)",
                ha="center", fontsize=9)
    ax.set_xlim(-radius - 0.75, radius + 0.75)
    ax.set_ylim(-radius - 0.85, radius + 0.6)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title if title is not None else frame_caption(n, frame), fontsize=10, wrap=True)
    return ax.figure  # type: ignore[return-value]


def render_ring_strip(world_size: int = 4) -> Figure:
    """Every frame of one ring all-reduce side by side: the animation on paper."""
    frames = 2 * (world_size - 1) + 1
    cols = min(frames, 4)
    rows = math.ceil(frames / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 5.2 * rows), squeeze=False)
    for k, ax in enumerate(axes.flat):
        if k < frames:
            phase = "start" if k == 0 else ring_steps(world_size, world_size)[k - 1].phase
            render_ring(world_size, k, ax=ax, title=f"frame {k}: {phase}", caption=False)
        else:
            ax.axis("off")
    fig.suptitle(f"Ring all-reduce on {world_size} ranks: reduce-scatter (red arrows, add) then "
                 "all-gather (blue arrows, copy)")
    fig.tight_layout(rect=(0, 0, 1, 0.96))  # leave the top strip to the suptitle
    return fig


def render_bandwidth(results: Any, ax: Optional[Axes] = None) -> Figure:
    """Bus bandwidth vs message size for both all-reduces, with the fitted ring model.

    Args:
        results: a ``parallel_lib.bench.allreduce.Results``.
        ax: axes to draw into; a new figure when None.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(7.5, 4.5))
    sizes = list(results.config.sizes)
    n = results.config.world_size
    for variant, label, marker in (("builtin", "dist.all_reduce", "o"), ("ring", "ring_all_reduce (ours)", "s")):
        ax.plot(sizes, [results.busbw(variant, s) / 1e9 for s in sizes], marker=marker, label=label)
    if not results.fit_error:
        model = [bus_bandwidth(s / allreduce_cost(s, n, results.bandwidth, results.latency), n) / 1e9 for s in sizes]
        ax.plot(sizes, model, "k--", label=f"ring model: B = {results.bandwidth / 1e9:.2f} GB/s, "
                                           f"α = {results.latency * 1e6:.0f} µs")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [f"{s // 2**20} MB" if s >= 2**20 else f"{s // 2**10} KB" for s in sizes], rotation=45)
    ax.set_yscale("log")  # small messages sit orders of magnitude below large ones
    ax.set_xlabel("message size")
    ax.set_ylabel("bus bandwidth (GB/s, log scale)")
    ax.set_title(f"All-reduce on {n} {results.backend} ranks, {results.machine}", fontsize=10)
    ax.legend()
    ax.grid(alpha=0.3)
    return ax.figure  # type: ignore[return-value]


def ring_widget(world_size: int = 4, world_sizes: tuple[int, ...] = (2, 3, 4, 5, 6)) -> Any:
    """The animation: a world-size selector, Play and a step slider over :func:`render_ring`.

    Returns:
        An ``ipywidgets.VBox`` to display as a cell's last expression; its
        ``children[1]`` is the HTML caption of the current frame.
    """
    import ipywidgets as w  # imported here: the library itself runs without a notebook
    from IPython.display import display

    size = w.Dropdown(options=list(world_sizes), value=world_size, description="ranks")
    play = w.Play(value=0, min=0, max=2 * (world_size - 1), step=1, interval=1200, description="play")
    frame = w.IntSlider(value=0, min=0, max=2 * (world_size - 1), description="step")
    w.jslink((play, "value"), (frame, "value"))  # the Play button drives the slider in the browser
    caption = w.HTML()
    output = w.Output()

    def redraw(_: Any = None) -> None:
        caption.value = frame_caption(size.value, frame.value)
        with output:
            output.clear_output(wait=True)
            fig = render_ring(size.value, frame.value)
            display(fig)
            plt.close(fig)  # one figure per frame, not one more each time the slider moves

    def resize(_: Any) -> None:
        frame.value = play.value = 0
        frame.max = play.max = 2 * (size.value - 1)
        redraw()

    size.observe(resize, names="value")
    frame.observe(redraw, names="value")
    redraw()
    return w.VBox([w.HBox([size, play, frame]), caption, output])
