"""Chapter 10's pictures of the calibrated planner: memory per layout, a layout's predicted step, predictions vs runs.

Drawing only: the numbers come from :mod:`parallel_lib.planner` (``plan_layouts``, ``price``) and
from the benchmark's rows (:mod:`parallel_lib.bench.planner`); the timeline goes through the
course's one plot function (:func:`parallel_lib.viz.timeline.plot_timeline`) fed by the schedule
simulator, so a predicted step reads like the measured ones of chapters 04 and 08.

- :func:`memory_bars`: the busiest rank's model state and activations per layout, against the card;
- :func:`predicted_timeline`: one layout's step as the simulator orders it, scaled to the planner's times;
- :func:`measured_vs_predicted`: the benchmark's rows, predicted against measured, with the ±25 % band;
- :func:`planner_figure` / :func:`planner_widget`: the planning widget (published GPU figures).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional, Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from parallel_lib.common.checks import check_choice, positive_int
from parallel_lib.common.timeline import Event
from parallel_lib.cost.units import GiB
from parallel_lib.pipeline_parallel.simulator import simulate
from parallel_lib.planner.hardware import GPUS, published_calibration
from parallel_lib.planner.layout import Priced, StepCost
from parallel_lib.planner.published import LLAMA3
from parallel_lib.planner.search import Candidate, LayoutPlan, plan_layouts
from parallel_lib.cost.shape import GPTShape
from parallel_lib.viz.timeline import plot_timeline
from parallel_lib.viz.widgets import figure_panel

__all__ = ["MODELS", "memory_bars", "predicted_events", "predicted_timeline", "measured_vs_predicted",
           "published_plan", "planner_figure", "planner_widget"]

# The models the widget offers: GPT-2 XL's and GPT-3 175B's published shapes (12h² per block), and
# Llama 3 8B and 405B as parallel_lib.planner.published shapes them (SwiGLU, GQA, untied head; sources there)
MODELS: dict[str, tuple[GPTShape, int]] = {   # name -> (shape, sequence length)
    "GPT-2 XL 1.5B": (GPTShape(48, 1600, 25, 50257, 1024), 1024),
    "Llama 3 8B": (LLAMA3["8B"], 4096),
    "GPT-3 175B": (GPTShape(96, 12288, 96, 51200, 2048), 2048),
    "Llama 3 405B": (LLAMA3["405B"], 8192),
}


def memory_bars(candidates: Sequence[Candidate], memory_per_device: float, ax: Optional[Axes] = None,
                title: str = "") -> Figure:
    """Stacked bars per layout: model state, ZeRO-3's gathered working set (if any) and activations of the busiest
    rank; hatched when it does not fit."""
    if not candidates:
        raise ValueError("candidates is empty: pass a LayoutPlan's ranked and/or rejected candidates")
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.35 * len(candidates) + 1.2))
    gathered_label = "ZeRO-3's gathered working set"
    for y, c in enumerate(candidates):
        if c.priced is None:  # refused before pricing (a batch that does not split): no bar to draw
            ax.text(0, y, f"  {c.why_not}", va="center", fontsize=7)
            continue
        hatch = None if c.fits else "//"
        state, acts = c.priced.state_bytes / GiB, c.priced.activation_bytes / GiB
        working = c.priced.working_bytes / GiB
        ax.barh(y, state, color="#4C72B0", hatch=hatch, edgecolor="white", label="model state" if y == 0 else None)
        if working:  # ZeRO-3 only
            ax.barh(y, working, left=state, color="#55A868", hatch=hatch, edgecolor="white",
                    label=gathered_label)
            gathered_label = None  # one legend entry
        ax.barh(y, acts, left=state + working, color="#DD8452", hatch=hatch, edgecolor="white",
                label="activations" if y == 0 else None)
    ax.axvline(memory_per_device / GiB, color="red", ls="--", lw=1,
               label=f"memory per device {memory_per_device / GiB:.4g} GiB")
    ax.set_yticks(range(len(candidates)), [c.layout.name for c in candidates], fontsize=7)
    ax.invert_yaxis()
    ax.set(xlabel="GiB on the busiest rank (hatched: does not fit)", title=title)
    ax.legend(fontsize=7, loc="lower right")
    return ax.figure


def predicted_events(priced: Priced) -> list[Event]:
    """A layout's step as events: the simulator's schedule scaled to ``priced.compute``, then the dp
    collectives and the optimizer on every pipeline rank (the course's engines overlap nothing)."""
    layout = priced.layout
    schedule = layout.schedule_object() if layout.pp > 1 else replace(layout, pp=1).schedule_object()
    unit = simulate(schedule, (1 / 3, 2 / 3))  # forward a third, backward two thirds of a stage's work
    span = max(e.end for e in unit) or 1.0
    scale = priced.compute / span
    events = [Event(e.lane, e.kind, e.micro_batch, e.start * scale, e.end * scale, e.label) for e in unit]
    for j in range(layout.pp):
        lane = f"stage {j}"
        if priced.dp_comm > 0:
            events.append(Event(lane, "comm", None, priced.compute, priced.compute + priced.dp_comm, "dp"))
        end = priced.compute + priced.dp_comm
        if priced.optimizer > 0:
            events.append(Event(lane, "comm", None, end, end + priced.optimizer, "optimizer"))
    return events


def predicted_timeline(priced: Priced, ax: Optional[Axes] = None, unit: str = "ms") -> Figure:
    """:func:`predicted_events` through the course's one timeline plot, titled with the layout."""
    return plot_timeline(predicted_events(priced), ax=ax, unit=unit,
                         title=f"predicted: {priced.layout.name}, {priced.step_seconds * 1e3:.1f} ms per step")


def measured_vs_predicted(rows: Sequence[Any], ax: Optional[Axes] = None, title: str = "") -> Figure:
    """Benchmark rows (``predicted_seconds``, ``measured_seconds``, ``layout``) on log–log axes, y = x ± 25 %."""
    if not rows:
        raise ValueError("rows is empty: pass parallel_lib.bench.planner's Row objects")
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 5))
    xs = [r.measured_seconds * 1e3 for r in rows]
    ys = [r.predicted_seconds * 1e3 for r in rows]
    low, high = min(xs + ys) * 0.7, max(xs + ys) * 1.4
    ax.plot([low, high], [low, high], color="black", lw=1, label="predicted = measured")
    ax.fill_between([low, high], [low * 0.75, high * 0.75], [low * 1.25, high * 1.25], color="grey", alpha=0.2,
                    label="within 25 %")
    for r, x, y in zip(rows, xs, ys):
        ax.scatter(x, y, s=25)
        ax.annotate(r.layout.name, (x, y), fontsize=7, xytext=(4, 2), textcoords="offset points")
    ax.set(xscale="log", yscale="log", xlim=(low, high), ylim=(low, high), xlabel="measured ms per step",
           ylabel="predicted ms per step", title=title)
    ax.legend(fontsize=7)
    return ax.figure


def published_plan(model: str, gpu: str, devices: int, global_batch: int) -> LayoutPlan:
    """The planner's layouts for ``model`` on ``devices`` of ``gpu``, priced with its published peaks (bf16)."""
    shape, seq = MODELS[check_choice("model", model, list(MODELS))]
    g = GPUS[check_choice("gpu", gpu, sorted(GPUS))]
    positive_int("devices", devices)
    return plan_layouts(shape, devices, g.memory_bytes, positive_int("global_batch", global_batch), seq,
                        published_calibration(gpu), StepCost(0.0, g.flops_bf16), dtype="bf16",
                        schedules=("1f1b", "interleaved"), zero_stages=(0, 1, 3), max_pp=16)


def planner_figure(model: str = "Llama 3 8B", gpu: str = "H100", devices: int = 64, global_batch: int = 256,
                   top: int = 6, misfits: int = 4) -> Figure:
    """The widget's picture: memory bars of the ``top`` fastest layouts and ``misfits`` that do not fit, each
    fitting one's predicted step time, and the fastest layout's predicted timeline (published peaks)."""
    plan = published_plan(model, gpu, devices, global_batch)
    shown = list(plan.ranked[:top]) + [c for c in plan.rejected if c.priced][:misfits]
    fig = plt.figure(figsize=(12, 7.5))
    grid = fig.add_gridspec(2, 2, height_ratios=(1.3, 1))
    where = f"{model}, {devices} × {gpu} (published peaks), batch {global_batch}"
    if shown:
        memory_bars(shown, plan.memory_per_device, fig.add_subplot(grid[0, 0]), title=where)
    ax = fig.add_subplot(grid[0, 1])
    fits = plan.ranked[:top]
    ax.barh(range(len(fits)), [c.priced.step_seconds for c in fits], color="#55A868")  # type: ignore[union-attr]
    ax.set_yticks(range(len(fits)), [c.layout.name for c in fits], fontsize=7)
    ax.invert_yaxis()
    ax.set(xlabel="predicted seconds per step (lower bound: peak FLOP/s)", title="ranked layouts that fit")
    if plan.best is not None and plan.best.priced is not None:
        predicted_timeline(plan.best.priced, fig.add_subplot(grid[1, :]), unit="s")
    else:
        fig.add_subplot(grid[1, :]).text(0.5, 0.5, "no layout fits: more devices or memory", ha="center")
    fig.tight_layout()
    return fig


def planner_widget() -> Any:
    """An ipywidgets panel: model, GPU, devices, global batch -> the planner's ranked layouts and misfits."""
    import ipywidgets as widgets

    controls = dict(
        model=widgets.Dropdown(options=list(MODELS), value="Llama 3 8B", description="model"),
        gpu=widgets.Dropdown(options=sorted(GPUS), value="H100", description="GPU"),
        devices=widgets.Dropdown(options=[8, 16, 32, 64, 128, 256], value=64, description="devices"),
        global_batch=widgets.Dropdown(options=[64, 256, 1024], value=256, description="batch (seq.)"))
    return figure_panel(planner_figure, controls, per_row=2)
