"""Chapter 06's pictures: per-rank model-state bytes measured beside the ZeRO formula, the ZeRO
calculator widget, and ZeRO-3's timeline measured beside its simulation.

Drawing only: the numbers come from :mod:`parallel_lib.sharding` (census, counter, formulas,
simulation), measured by the caller (a notebook cell or :mod:`parallel_lib.figures`).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from parallel_lib.common.timeline import Event
from parallel_lib.sharding.memory import zero_memory, zero_traffic
from parallel_lib.viz.timeline import plot_timeline
from parallel_lib.viz.widgets import figure_panel

__all__ = ["PARTS", "MODEL_SIZES", "OPTIMIZERS", "plot_zero_memory", "plot_zero_timelines", "calculator_figure",
           "zero_calculator"]

PARTS = {"params": ("parameters", "#4C72B0"), "grads": ("gradients", "#DD8452"),
         "optimizer": ("optimizer states (+ fp32 master)", "#C44E52")}


def plot_zero_memory(measured: Mapping[str, Mapping[str, float]], formula: Mapping[str, Mapping[str, float]],
                     sent: Optional[Mapping[str, float]] = None, expected: Optional[Mapping[str, float]] = None,
                     title: str = "", unit: float = 1e6, unit_name: str = "MB") -> Figure:
    """Stacked bars per variant: measured (solid) beside the formula (hatched); traffic on the right.

    Args:
        measured, formula: ``{variant: {"params", "grads", "optimizer"}}`` in bytes.
        sent, expected: ``{variant: bytes sent per step}`` counted and predicted (optional panel).
    """
    names = list(measured)
    panels = 2 if sent else 1
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels + 1, 4), squeeze=False)
    ax = axes[0][0]
    for x, name in enumerate(names):
        for offset, source, hatch in ((-0.2, measured, None), (0.2, formula, "//")):
            bottom = 0.0
            for part, (label, color) in PARTS.items():
                height = source[name][part] / unit
                ax.bar(x + offset, height, 0.38, bottom=bottom, color=color, hatch=hatch, edgecolor="white",
                       label=label if (x, offset) == (0, -0.2) else None)
                bottom += height
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right")
    ax.set_ylabel(f"{unit_name} per rank (left: census, right, hatched: formula)")
    ax.legend(fontsize=8)
    ax.set_title(title or "model state per rank")
    if sent:
        ax2 = axes[0][1]
        ax2.bar([x - 0.2 for x in range(len(names))], [sent[n] / unit for n in names], 0.38, color="#55A868",
                label="counted")
        ax2.bar([x + 0.2 for x in range(len(names))], [(expected or {}).get(n, 0.0) / unit for n in names], 0.38,
                color="#55A868", hatch="//", edgecolor="white", label="formula")
        ax2.set_xticks(range(len(names)), names, rotation=20, ha="right")
        ax2.set_ylabel(f"{unit_name} sent per rank and step")
        ax2.legend(fontsize=8)
        ax2.set_title("traffic")
    fig.tight_layout()
    return fig


def plot_zero_timelines(timelines: Mapping[str, Sequence[Event]], unit: str = "ms") -> Figure:
    """One Gantt chart per entry (e.g. measured / simulated, without / with prefetch), stacked."""
    fig, axes = plt.subplots(len(timelines), 1, figsize=(11, 1.9 * len(timelines) + 0.5), squeeze=False)
    for ax, (title, events) in zip(axes[:, 0], timelines.items()):
        plot_timeline(events, ax=ax, title=title, unit=unit, show_bubble=False)
    fig.tight_layout()
    return fig


# name -> billions of parameters
MODEL_SIZES = {"GPT-2 small (124M)": 0.124, "GPT-2 XL (1.5B)": 1.5, "ZeRO paper (7.5B)": 7.5, "LLaMA-2 7B": 6.74,
               "LLaMA-2 70B": 69.0}
# (label, precision, optimizer bytes per parameter or None for the precision's Adam default)
OPTIMIZERS = {"AdamW": None, "SGD + momentum": {"bf16": 8.0, "fp32": 4.0}, "SGD": {"bf16": 4.0, "fp32": 0.0}}


def calculator_figure(billions: float, world_size: int, stage: int, precision: str, optimizer: str) -> Figure:
    """The widget's picture: every stage's bytes per rank for the choice, the chosen stage outlined."""
    k = OPTIMIZERS[optimizer][precision] if OPTIMIZERS[optimizer] else None
    psi = billions * 1e9
    rows = {f"stage {s}": zero_memory(psi, world_size, s, precision, k) for s in range(4)}
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    for x, (name, parts) in enumerate(rows.items()):
        bottom = 0.0
        for part, (label, color) in PARTS.items():
            ax.bar(x, parts[part] / 1e9, 0.6, bottom=bottom, color=color, label=label if x == 0 else None,
                   edgecolor="black" if x == stage else "white", linewidth=2 if x == stage else 0.5)
            bottom += parts[part] / 1e9
        ax.text(x, bottom, f"{bottom:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(4), list(rows))
    ax.set_ylabel("GB per rank (model state)")
    ax.set_title(f"{billions:g}B parameters, {world_size} ranks, {precision}, {optimizer}")
    ax.legend(fontsize=8)
    traffic = [zero_traffic(psi, world_size, s, precision) / 1e9 for s in range(4)]
    ax2.bar(range(4), traffic, 0.6, color=["#55A868" if s != stage else "#2E7D32" for s in range(4)])
    ax2.set_xticks(range(4), list(rows))
    ax2.set_ylabel("GB sent per rank and step")
    ax2.set_title("traffic (ring): stage 3 is 1.5x data parallelism")
    fig.tight_layout()
    return fig


def zero_calculator() -> Any:
    """An ipywidgets panel: model size, ranks, stage, precision, optimizer -> bytes per rank and traffic."""
    import ipywidgets as widgets

    controls = dict(
        billions=widgets.Dropdown(options=list(MODEL_SIZES.items()), value=7.5, description="model"),
        world_size=widgets.IntSlider(value=64, min=1, max=1024, description="ranks"),
        stage=widgets.Dropdown(options=[0, 1, 2, 3], value=3, description="stage"),
        precision=widgets.Dropdown(options=["bf16", "fp32"], value="bf16", description="precision"),
        optimizer=widgets.Dropdown(options=list(OPTIMIZERS), value="AdamW", description="optimizer"))
    return figure_panel(calculator_figure, controls)
