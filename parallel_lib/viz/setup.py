"""Chapter 00's pictures: what an all-reduce left on each rank, and the tiny model's loss.

Both draw what the library returned: the ``(rank, before, after)`` triples of
``all_reduce_demo`` run by ``launch``, and a ``train.TrainRecord`` from
``quickstart.tiny_run``. ``figures()`` runs that same code, so the images under
``figures/`` show a real run, labelled with the machine it ran on.
"""

from __future__ import annotations

from typing import Optional, Sequence

import matplotlib.pyplot as plt
import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from parallel_lib.common.training import TrainRecord

__all__ = ["plot_all_reduce", "plot_loss"]

CMAP = plt.get_cmap("tab10")  # one colour per rank


def plot_all_reduce(results: Sequence[tuple[int, torch.Tensor, torch.Tensor]],
                    ax: Optional[Axes] = None) -> Figure:
    """Each rank's value before, and the stacked contributions that make up its value after.

    Args:
        results: ``launch(all_reduce_demo, world_size)``, i.e. ``(rank, before, after)``
            per rank; the first element of each tensor is drawn.
        ax: axes to draw into; a new figure when None.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(2 + 1.6 * len(results), 3.5))
    befores = [float(before[0]) for _, before, _ in results]
    for rank, before, after in results:
        ax.bar(rank - 0.2, befores[rank], width=0.35, color=CMAP(rank), alpha=0.5)
        ax.text(rank - 0.2, befores[rank], f"{befores[rank]:g}", ha="center", va="bottom")
        bottom = 0.0
        for source, value in enumerate(befores):  # the sum, drawn as what each rank sent in
            ax.bar(rank + 0.2, value, width=0.35, bottom=bottom, color=CMAP(source),
                   edgecolor="white")
            bottom += value
        ax.text(rank + 0.2, bottom, f"{float(after[0]):g}", ha="center", va="bottom",
                fontweight="bold")
    ax.set_xticks([r for r, _, _ in results],
                  [f"rank {r}\nbefore | after" for r, _, _ in results])
    ax.legend(handles=[Patch(color=CMAP(r), label=f"from rank {r}") for r in range(len(befores))],
              fontsize=8, loc="upper left")
    ax.set_ylabel("tensor value")
    ax.set_ylim(0, sum(befores) * 1.3)
    ax.set_title(f"all_reduce(SUM) over {len(results)} ranks: every rank ends with the sum",
                 fontsize=10)
    ax.figure.tight_layout()
    return ax.figure


def plot_loss(record: TrainRecord, machine: str, skip: int = 2,
              ax: Optional[Axes] = None) -> Figure:
    """Training loss per step, titled with the machine and the measured throughput.

    Args:
        record: from ``train`` (or ``quickstart.tiny_run``).
        machine: where it ran, e.g. ``dist.machine_label()``.
        skip: warm-up steps left out of the tokens/s in the title.
        ax: axes to draw into; a new figure when None.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, record.steps + 1), record.losses, marker=".", color=CMAP(0))
    ax.set_xlabel("step")
    ax.set_ylabel("loss (cross-entropy per target token)")
    ax.set_title(f"tiny GPT-2, de→en, one device: {record.throughput(skip):,.0f} target tokens/s\n"
                 f"measured on {machine}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.figure.tight_layout()
    return ax.figure
