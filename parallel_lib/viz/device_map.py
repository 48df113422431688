"""Pictures of device maps and of measured model-parallel throughput.

A device map drawn as a devices x layers grid shows at a glance what the printed
dict hides: whether blocks are contiguous, how many layers each device carries,
and which device sits idle.
"""

from __future__ import annotations

from typing import Mapping, Optional

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from parallel_lib.model_parallel.device_map import DeviceMap

__all__ = ["plot_device_maps", "plot_throughput"]

CMAP = plt.get_cmap("tab10")


def plot_device_maps(maps: Mapping[str, DeviceMap], title: str = "") -> Figure:
    """One panel per map: a filled cell where a device (row) holds a layer (column).

    Args:
        maps: ``{panel title: device map}``, drawn left to right.
        title: figure heading.
    """
    fig, axes = plt.subplots(1, len(maps), figsize=(5 * len(maps), 0.45 * max(map(len, maps.values())) + 1.4),
                             squeeze=False)
    for ax, (name, device_map) in zip(axes[0], maps.items()):
        n_layers = sum(map(len, device_map.values()))
        for row, (key, layers) in enumerate(device_map.items()):
            for layer in layers:
                ax.add_patch(plt.Rectangle((layer, row), 0.92, 0.85, color=CMAP(row % 10)))
            ax.text(n_layers + 0.2, row + 0.42, f"{len(layers)} layers" if layers else "idle", va="center", fontsize=9)
        ax.set_xlim(0, n_layers + 2.2)
        ax.set_ylim(len(device_map), 0)
        ax.set_xticks([i + 0.46 for i in range(n_layers)], [str(i) for i in range(n_layers)], fontsize=8)
        ax.set_yticks([r + 0.42 for r in range(len(device_map))], [f"device {k}" for k in device_map])
        ax.set_xlabel("layer")
        ax.set_title(name, fontsize=10)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_throughput(tokens_per_second: Mapping[str, float], machine: str, ax: Optional[plt.Axes] = None) -> Figure:
    """Bars of measured training tokens/s, one per configuration, labelled with the machine."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3))
    names, rates = list(tokens_per_second), list(tokens_per_second.values())
    bars = ax.bar(names, rates, color=[CMAP(i) for i in range(len(names))])
    ax.bar_label(bars, fmt="%.0f", fontsize=9)
    ax.set_ylabel("tokens / s (training)")
    ax.set_title(f"measured on {machine}", fontsize=10)
    ax.figure.tight_layout()
    return ax.figure
