"""Pictures of device maps and of a measured model-parallel step.

A device map drawn as a devices x layers grid shows at a glance what the printed
dict hides: whether blocks are contiguous, how many layers each device carries,
and which device sits idle.
"""

from __future__ import annotations

from typing import Mapping, Optional

import matplotlib.pyplot as plt
import torch
from matplotlib.figure import Figure

from ..device_map import DeviceMap, get_device_map, naive_device_map
from ..timeline import makespan

__all__ = ["plot_device_maps", "measured_step_timeline", "plot_throughput", "figures"]

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


def measured_step_timeline(device_map: Optional[DeviceMap] = None, batch_size: int = 8, seq_len: int = 64,
                           steps: int = 5) -> Figure:
    """Record forward + backward steps of the tiny GPT-2 split by ``device_map``; draw the fastest.

    The bars are measured on this machine (labelled with it); the lanes are the map's keys.
    Of ``steps`` recorded steps the one with the shortest makespan is drawn: the step least
    disturbed by other programs on the machine.
    """
    from ..dist import machine_label
    from ..model_parallel import parallelize, record_timeline
    from ..models import build_gpt2
    from .timeline import plot_timeline

    model = parallelize(build_gpt2("tiny", vocab_size=1024), device_map or get_device_map(4, [0, 1, 2, 3]))
    ids = torch.randint(0, 1024, (batch_size, seq_len), generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is as fast, and spared oversubscribed cores' stalls
    try:
        model(input_ids=ids, labels=ids).loss.backward()  # warm-up: the first pass allocates
        with record_timeline(model) as events:
            for _ in range(steps):
                model(input_ids=ids, labels=ids).loss.backward()
    finally:
        torch.set_num_threads(threads)
    by_step = [[e for e in events if e.micro_batch == step] for step in range(steps)]
    fastest = min(by_step, key=makespan)
    return plot_timeline(fastest, title=f"tiny GPT-2, one step split over {len(model.device_map)} devices "
                                        f"({machine_label()})")


def figures() -> dict[str, Figure]:
    """The 12-on-5 maps side by side, and a measured one-device-at-a-time step."""
    return {
        "device_map_12_on_5": plot_device_maps({"classic: blocks of ceil(12 / 5) = 3": naive_device_map(12, range(5)),
                                                "balanced: get_device_map": get_device_map(12, range(5))},
                                               title="12 GPT-2 layers on 5 devices"),
        "model_parallel_timeline": measured_step_timeline(),
    }


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
