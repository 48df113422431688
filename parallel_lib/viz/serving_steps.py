"""The serving engine step by step, replayed from its own records: the block pool and the batch.

Every frame is one :class:`~parallel_lib.serving.engine.StepRecord` of a real run (``engine.records``):

- **the pool**: one cell per block, coloured by the request whose block table holds it (its
  position in that table written inside: ``r2 #1`` is request 2's second block), free blocks grey
  ("freed": a request that finished in this step gave it back);
  a block that several tables hold (a shared prefix) names all of them;
- **the batch over time**: one row per request, one column per step, coloured by what the request
  did in that step (fed its prompt or a chunk of it, decoded one token, was preempted, finished);
  the current step is framed.

So the picture shows what the scheduler did, not what it was meant to do: a request that grows
takes its next block only when its last one is full, a preempted request's blocks go back to the
pool at once, and it comes back later to be recomputed. :func:`render_serving_step` is a pure
function (records, step) -> figure; :func:`serving_steps_widget` calls it on every frame and
:func:`render_serving_strip` draws a few steps on paper (``figures/serving_steps.png``).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from parallel_lib.common.checks import check_int, positive_int

__all__ = ["STATES", "step_states", "block_owners", "serving_step_caption", "render_serving_step",
           "render_serving_strip", "serving_steps_widget"]

# what a request did in a step, in the order a cell is coloured when several apply
STATES = ("preempted", "finished", "prefill", "decode")
_PREEMPTED = "#C44E52"
_FREE = "#E5E5E5"
_PER_ROW = 16  # pool cells per row


def _request_color(request: int) -> Any:
    return plt.get_cmap("Set3")(request % 12)


def _check(records: Sequence[Any], step: int) -> None:
    if not records:
        raise ValueError("records must hold the StepRecords of a run (engine.records), got none")
    check_int("step", step, minimum=0, maximum=len(records) - 1, hint=f"the run has {len(records)} steps")


def step_states(records: Sequence[Any]) -> dict[int, list[str]]:
    """What each request did in each step: ``{request: [state or "" per step]}``, states from :data:`STATES`.

    A request preempted in a step did not run in it; a request that finished in a step ran in it
    (its last token); "" means it waited, had not arrived or was done.
    """
    requests = sorted({r for rec in records for r in (*rec.prefill, *rec.decode, *rec.preempted)})
    states: dict[int, list[str]] = {r: [] for r in requests}
    for rec in records:
        for r in requests:
            flags = {"preempted": r in rec.preempted, "finished": r in rec.finished,
                     "prefill": r in rec.prefill, "decode": r in rec.decode}
            states[r].append(next((s for s in STATES if flags[s]), ""))
    return states


def block_owners(record: Any, num_blocks: int) -> list[list[tuple[int, int]]]:
    """For each block of the pool after ``record``'s step, the (request, position in its table) pairs holding it.

    Raises:
        ValueError: a table names a block outside ``0 .. num_blocks - 1``.
    """
    owners: list[list[tuple[int, int]]] = [[] for _ in range(num_blocks)]
    for request, table in sorted(record.tables.items()):
        for k, block in enumerate(table):
            if not 0 <= block < num_blocks:
                raise ValueError(f"request {request}'s block table {table} names block {block}, outside a pool "
                                 f"of num_blocks={num_blocks}; pass the engine's num_blocks")
            owners[block].append((request, k))
    return owners


def _names(ids: Sequence[int]) -> str:
    return ", ".join(f"r{i}" for i in ids) if ids else "none"


def serving_step_caption(records: Sequence[Any], step: int) -> str:
    """One line saying what step ``step`` did (who fed a prompt, decoded, was preempted, finished)."""
    _check(records, step)
    rec = records[step]
    prefill = ", ".join(f"r{r} ({rec.fed.get(r, '?')} token{'' if rec.fed.get(r) == 1 else 's'})"
                        for r in rec.prefill) or "none"
    return (f"step {step}: prefill {prefill}; decode {_names(rec.decode)}; admitted {_names(rec.admitted)}; "
            f"preempted {_names(rec.preempted)}; finished {_names(rec.finished)}; {rec.free_blocks} blocks free")


def _draw_pool(ax: Axes, record: Any, num_blocks: int, title: str) -> None:
    owners = block_owners(record, num_blocks)
    rows = -(-num_blocks // _PER_ROW)
    for block, owned in enumerate(owners):
        held = [(r, k) for r, k in owned if r not in record.finished]  # a finished request's blocks are freed
        x, y = block % _PER_ROW, -(block // _PER_ROW)
        color = _request_color(held[0][0]) if held else _FREE
        ax.add_patch(Rectangle((x + 0.05, y + 0.05), 0.9, 0.9, facecolor=color, edgecolor="black", linewidth=0.8))
        label = "\n".join(f"r{r} #{k}" for r, k in held) if held else ("freed" if owned else "free")
        ax.text(x + 0.5, y + 0.5, label, ha="center", va="center", fontsize=8, color="black" if held else "#777777")
        ax.text(x + 0.5, y + 1.05, f"{block}", ha="center", va="bottom", fontsize=6, color="#555555")
    ax.set_xlim(0, min(num_blocks, _PER_ROW))
    ax.set_ylim(-rows + 1, 1.3)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title, fontsize=9, loc="left")


def _draw_batch(ax: Axes, records: Sequence[Any], step: Optional[int]) -> None:
    states = step_states(records)
    requests = list(states)
    for row, r in enumerate(requests):
        for t, state in enumerate(states[r]):
            if state == "preempted":  # it left the batch: its cell is empty, crossed in red
                ax.plot([t + 0.2, t + 0.8], [row + 0.2, row + 0.8], color=_PREEMPTED, linewidth=1.5)
                ax.plot([t + 0.2, t + 0.8], [row + 0.8, row + 0.2], color=_PREEMPTED, linewidth=1.5)
            elif state:
                ax.add_patch(Rectangle((t, row), 1, 1, facecolor=_request_color(r), edgecolor="white", linewidth=0.5,
                                       hatch="///" if state == "prefill" else None))
                text = str(records[t].fed.get(r, "")) if state == "prefill" else ("end" if state == "finished" else "")
                if text:
                    ax.text(t + 0.5, row + 0.5, text, ha="center", va="center", fontsize=6, color="black",
                            bbox=dict(facecolor="white", edgecolor="none", pad=0.5, alpha=0.8))
    if step is not None:
        ax.add_patch(Rectangle((step, 0), 1, len(requests), fill=False, edgecolor="black", linewidth=2))
    ax.set_xlim(0, len(records))
    ax.set_ylim(len(requests), 0)
    ax.set_yticks([i + 0.5 for i in range(len(requests))], [f"r{r}" for r in requests], fontsize=8)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title("the batch, step by step: hatched = prefill (tokens fed written), plain = decode, "
                 "end = its last token, red cross = preempted", fontsize=8, loc="left")


def render_serving_step(records: Sequence[Any], step: int, num_blocks: int) -> Figure:
    """One frame: the pool after step ``step`` (above) and every request's state over the steps (below).

    Args:
        records: a run's :class:`~parallel_lib.serving.engine.StepRecord` list (``engine.records``).
        step: the frame, 0 .. len(records) - 1.
        num_blocks: the engine's pool size.

    Raises:
        ValueError: no records, a step out of range, or a table naming a block outside the pool.
    """
    _check(records, step)
    positive_int("num_blocks", num_blocks)
    rows = -(-num_blocks // _PER_ROW)
    fig, (pool, batch) = plt.subplots(2, 1, figsize=(9, 1.2 * rows + 3.2),
                                      gridspec_kw={"height_ratios": [1.1 * rows, 2.2]})
    _draw_pool(pool, records[step], num_blocks, f"the pool after the step: {num_blocks} blocks, "
                                                f"{records[step].free_blocks} free")
    _draw_batch(batch, records, step)
    fig.suptitle(serving_step_caption(records, step), fontsize=9, wrap=True)
    fig.tight_layout()
    return fig


def _changes(records: Sequence[Any]) -> list[int]:
    return [i for i, rec in enumerate(records) if rec.admitted or rec.preempted or rec.finished]


def render_serving_strip(records: Sequence[Any], num_blocks: int, steps: Optional[Sequence[int]] = None,
                         title: str = "") -> Figure:
    """A few steps' pools one under the other, then the batch over every step: the widget on paper.

    Args:
        records, num_blocks: as :func:`render_serving_step`.
        steps: the steps whose pool is drawn (default: the first six where a request was admitted,
            preempted or finished).
        title: the figure's heading.

    Raises:
        ValueError: as :func:`render_serving_step`.
    """
    positive_int("num_blocks", num_blocks)
    steps = list(steps) if steps is not None else _changes(records)[:6]
    for step in steps:
        _check(records, step)
    rows = -(-num_blocks // _PER_ROW)
    fig, axes = plt.subplots(len(steps) + 1, 1, figsize=(9, 0.75 * rows * len(steps) + 3.4),
                             gridspec_kw={"height_ratios": [0.8 * rows] * len(steps) + [2.6]})
    for ax, step in zip(axes, steps):
        _draw_pool(ax, records[step], num_blocks, serving_step_caption(records, step))
    _draw_batch(axes[-1], records, None)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def serving_steps_widget(records: Sequence[Any], num_blocks: int) -> Any:
    """Play and a step slider over :func:`render_serving_step`; returns an ``ipywidgets.VBox`` (caption: child 1).

    Raises:
        ValueError: no records.
    """
    import ipywidgets as w  # imported here: the library runs without a notebook
    from IPython.display import display

    _check(records, 0)
    last = len(records) - 1
    play = w.Play(value=0, min=0, max=last, step=1, interval=1200, description="play")
    frame = w.IntSlider(value=0, min=0, max=last, description="step")
    w.jslink((play, "value"), (frame, "value"))
    caption, output = w.HTML(), w.Output()

    def redraw(_: Any = None) -> None:
        caption.value = serving_step_caption(records, frame.value)
        with output:
            output.clear_output(wait=True)
            fig = render_serving_step(records, frame.value, num_blocks)
            display(fig)
            plt.close(fig)  # one figure per frame, not one more each time the slider moves

    frame.observe(redraw, names="value")
    redraw()
    return w.VBox([w.HBox([play, frame]), caption, output])
