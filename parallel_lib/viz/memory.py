"""The memory calculator: per-device training memory as stacked bars, and its widget.

Everything drawn comes from :mod:`parallel_lib.model_parallel.memory`'s estimates; the widget only
re-draws :func:`plot_memory` when a control changes, so the static figure under
``figures/`` and the interactive one are the same picture.
"""

from __future__ import annotations

from typing import Any, Optional

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from parallel_lib.cost.shape import SHAPES
from parallel_lib.model_parallel.memory import (
    DTYPE_BYTES,
    GiB,
    TrainingMemory,
    memory_verdict,
    model_memory,
)

__all__ = ["plot_memory", "memory_calculator"]

PARTS = {  # TrainingMemory field -> (legend, colour)
    "weights": ("weights", "#4C72B0"),
    "gradients": ("gradients", "#DD8452"),
    "master_weights": ("fp32 master weights", "#8172B3"),
    "optimizer_states": ("optimizer states", "#C44E52"),
    "activations": ("activations", "#55A868"),
}
DEVICE_GIB = [("16 GiB (V100 16GB)", 16), ("24 GiB (RTX 4090, A10)", 24), ("40 GiB (A100 40GB)", 40),
              ("80 GiB (A100/H100 80GB)", 80)]
OPTIMIZERS = [("AdamW", "adamw"), ("SGD + momentum", "sgd_momentum"), ("SGD", "sgd"), ("none: inference", "none")]


def plot_memory(estimate: TrainingMemory, device_bytes: float, n_devices: int = 4, max_devices: int = 8,
                title: str = "", ax: Optional[Axes] = None) -> Figure:
    """Stacked per-device memory for 1..max_devices devices, against one device's capacity.

    Args:
        estimate: whole-model bytes by kind (:func:`parallel_lib.model_parallel.memory.training_memory`).
        device_bytes: memory of one device; drawn as a dashed line.
        n_devices: the bar to outline (the reader's choice).
        max_devices: rightmost bar (raised to ``n_devices`` if smaller).
        title: heading; the verdict for ``n_devices`` is added under it.
        ax: axes to draw into; a new figure when None.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 4))
    counts = list(range(1, max(max_devices, n_devices) + 1))
    bottom = [0.0] * len(counts)
    for field, (label, color) in PARTS.items():
        heights = [getattr(estimate, field) / n / GiB for n in counts]
        if any(heights):
            ax.bar(counts, heights, bottom=bottom, color=color, label=label)
            bottom = [b + h for b, h in zip(bottom, heights)]
    ax.bar([n_devices], [bottom[n_devices - 1]], fill=False, edgecolor="black", linewidth=2)
    ax.axhline(device_bytes / GiB, color="black", linestyle="--", label=f"one device: {device_bytes / GiB:.0f} GiB")
    ax.set_xticks(counts)
    ax.set_xlabel("devices (layers split evenly: naive model parallelism)")
    ax.set_ylabel("GiB per device")
    ax.set_title(f"{title}\n{memory_verdict(estimate, n_devices, device_bytes)}".strip(), fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    ax.figure.tight_layout()
    return ax.figure


def _draw(model: str, dtype: str, optimizer: str, n_devices: int, device_gib: int, batch_size: int) -> None:
    opt = None if optimizer == "none" else optimizer
    estimate = model_memory(model, dtype, opt, batch_size)
    setting = f"{model}, {dtype}{' mixed precision' if DTYPE_BYTES[dtype] < 4 and opt else ''}, {optimizer}"
    fig = plot_memory(estimate, device_gib * GiB, n_devices, title=setting)
    from IPython.display import display  # the widget's output area shows what is displayed

    display(fig)
    plt.close(fig)  # one figure per redraw, not one more each time a slider moves


def memory_calculator(model: str = "llama-2-7b", dtype: str = "fp16", optimizer: str = "adamw",
                      n_devices: int = 4, device_gib: int = 16, batch_size: int = 0) -> Any:
    """An ipywidgets panel: choose model, dtype, optimizer, devices; see per-device memory.

    ``batch_size`` counts sequences of the model's full context whose activations are
    kept (0: weights, gradients and optimizer states only).

    Returns:
        An ``ipywidgets.VBox`` to display as a cell's last expression.
    """
    import ipywidgets as w  # imported here: the library itself runs without a notebook

    style = {"description_width": "initial"}
    controls = dict(
        model=w.Dropdown(options=list(SHAPES), value=model, description="model", style=style),
        dtype=w.Dropdown(options=list(DTYPE_BYTES), value=dtype, description="dtype", style=style),
        optimizer=w.Dropdown(options=OPTIMIZERS, value=optimizer, description="optimizer", style=style),
        n_devices=w.IntSlider(value=n_devices, min=1, max=16, description="devices", style=style),
        device_gib=w.Dropdown(options=DEVICE_GIB, value=device_gib, description="device memory", style=style),
        batch_size=w.IntSlider(value=batch_size, min=0, max=8, description="sequences of activations", style=style),
    )
    output = w.interactive_output(_draw, controls)
    boxes = list(controls.values())
    return w.VBox([w.HBox(boxes[:3]), w.HBox(boxes[3:]), output])
