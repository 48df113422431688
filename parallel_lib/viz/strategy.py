"""Choosing a strategy, drawn: the planner's options, the decision map, the widget, measured bars.

Every number drawn here comes from :func:`parallel_lib.planner.strategy.plan` (each named layout priced
by :func:`parallel_lib.planner.layout.price`) or
from the measured runs of :mod:`parallel_lib.planner.compare` and :mod:`parallel_lib.training` (chapter 05's DP × PP);
the widget only calls :func:`plot_plan` and ``Plan.explain`` again when a control
changes, so the static figure and the interactive one are the same picture.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from parallel_lib.cost.shape import SHAPES
from parallel_lib.cost.units import GiB
from parallel_lib.planner.hardware import Links
from parallel_lib.planner.strategy import PART_ONE, Plan, plan
from parallel_lib.viz.memory import DEVICE_GIB, PARTS

__all__ = ["DECISION_MODELS", "plot_plan", "plot_decision_map", "plot_measured", "strategy_widget"]

DECISION_MODELS = ["gpt2 (124M)", "gpt2-xl (1.5B)", "llama-2-7b", "llama-2-13b", "llama-2-70b"]  # the map's rows
STRATEGY_COLORS = {"DP": "#4C72B0", "MP": "#8172B3", "PP": "#DD8452", "DP×PP": "#55A868"}
# the clusters the widget offers: each group priced on the link it crosses (NVLink inside a node, the network across)
LINKS = [("DGX H100 · NVLink 450 / InfiniBand 50 GB/s", Links.of("H100")),
         ("DGX A100 · NVLink 300 / InfiniBand 25 GB/s", Links.of("A100")),
         ("PCIe 4.0 x16 25 / 100 Gb/s Ethernet 12.5 GB/s", Links(25e9, 12.5e9, 8, "PCIe", "Ethernet"))]


def plot_plan(chosen: Plan, ax: Optional[Axes] = None) -> Figure:
    """Memory per device of every option (state + activations) against one GPU's memory.

    Infeasible options are hatched; each bar is labelled with its layout
    (replicas x stages), bubble and the GB each device sends per step.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 4))
    names = [o.strategy for o in chosen.options]
    for x, o in enumerate(chosen.options):
        hatch = None if o.feasible else "//"
        alpha = 1.0 if o.feasible else 0.45
        ax.bar(x, o.state_bytes / GiB, color=PARTS["weights"][1], hatch=hatch, alpha=alpha)
        ax.bar(x, o.activation_bytes / GiB, bottom=o.state_bytes / GiB, color=PARTS["activations"][1],
               hatch=hatch, alpha=alpha)
        ax.text(x, o.memory_bytes / GiB, f"{o.replicas}x{o.stages}, m={o.micro_batches}\nbubble {o.bubble:.0%}\n"
                f"{o.comm_bytes / 1e9:.2f} GB sent\nstep {o.step_seconds:.2f} s", ha="center", va="bottom", fontsize=8,
                bbox=dict(facecolor="white", edgecolor="none", alpha=0.8))
    ax.axhline(chosen.gpu_bytes / GiB, color="black", linestyle="--")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("GiB per device")
    ax.set_ylim(0, 1.35 * max(max(o.memory_bytes for o in chosen.options), chosen.gpu_bytes) / GiB)
    best = chosen.best
    pick = f"pick: {best.strategy} {best.replicas}x{best.stages}" if best else "nothing fits"
    ax.set_title(f"{chosen.model}, {chosen.batch_size} x {chosen.seq_len} tokens, {chosen.n_gpus} GPUs of "
                 f"{chosen.gpu_bytes / GiB:g} GiB: {pick}", fontsize=10)
    ax.legend(handles=[Patch(color=PARTS["weights"][1], label="training state"),
                       Patch(color=PARTS["activations"][1], label="activations"),
                       Patch(facecolor="white", edgecolor="black", hatch="//", label="does not fit"),
                       plt.Line2D([], [], color="black", linestyle="--", label="one GPU")],
              fontsize=8, loc="upper right")
    ax.figure.tight_layout()
    return ax.figure


def plot_decision_map(models: Sequence[str], gpu_counts: Sequence[int], gpu_gib: float, seq_len: int,
                      batch_size: int, ax: Optional[Axes] = None) -> Figure:
    """The planner's pick for each model (rows) and number of GPUs (columns); grey: nothing fits.

    "+R" marks a pick that needs activation recomputation.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(1.0 * len(gpu_counts) + 3, 0.55 * len(models) + 1.5))
    codes = {name: k + 1 for k, name in enumerate(PART_ONE)}
    grid = []
    for model in models:
        row = []
        for n in gpu_counts:
            best = plan(model, seq_len, batch_size, gpu_gib, n).best
            label = (f"{best.strategy}\n{best.replicas}x{best.stages}{' +R' if best.recompute else ''}"
                     if best else "—")
            row.append((codes[best.strategy] if best else 0, label))
        grid.append(row)
    cmap = ListedColormap(["#DDDDDD"] + [STRATEGY_COLORS[s] for s in PART_ONE])
    ax.imshow([[code for code, _ in row] for row in grid], cmap=cmap, vmin=0, vmax=len(PART_ONE), aspect="auto")
    for y, row in enumerate(grid):
        for x, (_, text) in enumerate(row):
            ax.text(x, y, text, ha="center", va="center", fontsize=7, color="white" if text != "—" else "black")
    ax.set_xticks(range(len(gpu_counts)), [str(n) for n in gpu_counts])
    ax.set_yticks(range(len(models)), models)
    ax.set_xlabel(f"GPUs of {gpu_gib:g} GiB")
    ax.set_title(f"The planner's pick (replicas x stages), {batch_size} sequences of {seq_len} tokens per step",
                 fontsize=10)
    ax.figure.tight_layout()
    return ax.figure


def plot_measured(values: Mapping[str, Mapping[str, float]], machine: str, axes: Optional[Sequence[Axes]] = None
                  ) -> Figure:
    """One bar panel per measured quantity: ``values[quantity][strategy]``, labelled with the machine."""
    if axes is None:
        _, axes = plt.subplots(1, len(values), figsize=(3.6 * len(values), 3.2), squeeze=False)
        axes = list(axes[0])
    for ax, (quantity, by_strategy) in zip(axes, values.items()):
        names = list(by_strategy)
        colors = [STRATEGY_COLORS.get(name.split()[0], "#999999") for name in names]
        ax.bar(range(len(names)), list(by_strategy.values()), color=colors)
        ax.set_xticks(range(len(names)), names, fontsize=8)
        ax.set_title(quantity, fontsize=9)
    fig = axes[0].figure
    fig.suptitle(f"measured on {machine}", fontsize=9)
    fig.tight_layout()
    return fig


def strategy_widget(model: str = "llama-2-7b", seq_len: int = 4096, batch_size: int = 64, gpu_gib: int = 80,
                    n_gpus: int = 8) -> Any:
    """The decision widget: model, sequence length, batch, GPU memory and count in; options out.

    Returns:
        An ``ipywidgets.VBox``; its ``children[-2]`` is the HTML table and reasoning, the
        last child the plot (an ``Output``).
    """
    import ipywidgets as w  # imported here: the library itself runs without a notebook
    from IPython.display import display

    style = {"description_width": "initial"}
    controls = dict(
        model=w.Dropdown(options=list(SHAPES), value=model, description="model", style=style),
        seq_len=w.Dropdown(options=[2**k for k in range(7, 15)], value=seq_len, description="sequence length",
                           style=style),
        batch_size=w.IntSlider(value=batch_size, min=1, max=512, description="sequences per step", style=style),
        gpu_gib=w.Dropdown(options=DEVICE_GIB, value=gpu_gib, description="GPU memory", style=style),
        n_gpus=w.IntSlider(value=n_gpus, min=1, max=64, description="GPUs", style=style),
        links=w.Dropdown(options=LINKS, value=LINKS[0][1], description="links", style=style),
    )
    report, output = w.HTML(), w.Output()

    def redraw(_: Any = None) -> None:
        values = {name: control.value for name, control in controls.items()}
        chosen = plan(values.pop("model"), **values)
        rows = "".join(
            f"<tr style='color:{'black' if o.feasible else '#999'}'><td><b>{o.strategy}</b></td>"
            f"<td>{o.replicas} x {o.stages}</td><td>{o.micro_batches}</td><td>{o.memory_bytes / GiB:.1f}</td>"
            f"<td>{'yes' if o.feasible else 'no'}</td><td>{o.bubble:.0%}</td><td>{o.comm_bytes / 1e9:.3f}</td>"
            f"<td>{o.comm_seconds * 1e3:.0f}</td><td>{o.step_seconds:.2f}</td></tr>" for o in chosen.options)
        head = ("<tr><th>strategy</th><th>replicas x stages</th><th>m</th><th>GiB per GPU</th><th>fits</th>"
                "<th>bubble</th><th>GB sent per GPU and step</th><th>comm ms</th><th>step s</th></tr>")
        reasoning = chosen.explain().replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        report.value = f"<table>{head}{rows}</table><pre style='font-size:11px'>{reasoning}</pre>"
        with output:
            output.clear_output(wait=True)
            fig = plot_plan(chosen)
            display(fig)
            plt.close(fig)  # one figure per redraw, not one more each time a control moves

    for control in controls.values():
        control.observe(redraw, names="value")
    redraw()
    boxes = list(controls.values())
    return w.VBox([w.HBox(boxes[:3]), w.HBox(boxes[3:]), report, output])
