"""Chapter 11's two measured pictures: attention's memory against sequence length, and each rank's causal work.

Both draw numbers measured elsewhere (the tensor census of
:func:`~parallel_lib.context_parallel.tiled.saved_attention_bytes`,
the tiles ring attention counted on each rank) beside the formula that predicts them; nothing here measures.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from parallel_lib.viz.ring import rank_color

__all__ = ["plot_attention_memory", "plot_rank_work"]


def plot_attention_memory(seq_lens: Sequence[int], measured: Mapping[str, Sequence[float]],
                          formula: Mapping[str, Sequence[float]], title: str = "",
                          ax: Optional[Axes] = None) -> Figure:
    """Bytes kept for backward against sequence length, log-log: measured points over the formula's line.

    Args:
        seq_lens: the lengths measured.
        measured: ``{method: bytes at each length}`` from the census.
        formula: ``{method: bytes at each length}`` from
            :func:`~parallel_lib.context_parallel.cost.attention_saved_bytes`.
        title: the axes' title.
        ax: axes to draw into; a new figure when None.

    Raises:
        ValueError: a series whose length differs from ``seq_lens``.
    """
    for name, series in (*measured.items(), *formula.items()):
        if len(series) != len(seq_lens):
            raise ValueError(f"every series needs one value per length ({len(seq_lens)}), got {len(series)} for "
                             f"{name!r}")
    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 4.2))
    for k, (method, series) in enumerate(formula.items()):
        ax.plot(seq_lens, series, "-", color=f"C{k}", alpha=0.6, label=f"{method}: formula")
        if method in measured:
            ax.plot(seq_lens, measured[method], "o", color=f"C{k}", label=f"{method}: tensor census")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("sequence length s (tokens)")
    ax.set_ylabel("bytes kept for backward (log scale)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return ax.figure  # type: ignore[return-value]


def plot_rank_work(work: Mapping[str, Sequence[float]], title: str = "", ylabel: str = "score entries computed",
                   ax: Optional[Axes] = None) -> Figure:
    """One group of bars per run (``{label: each rank's work}``), a bar per rank in its colour.

    Raises:
        ValueError: no runs.
    """
    if not work:
        raise ValueError("work must hold at least one {label: per-rank values}")
    if ax is None:
        _, ax = plt.subplots(figsize=(7.0, 3.8))
    width, named = 0.8 / max(len(v) for v in work.values()), set()
    for g, (label, values) in enumerate(work.items()):
        for r, value in enumerate(values):
            ax.bar(g + (r - (len(values) - 1) / 2) * width, value, width * 0.9, color=rank_color(r),
                   label=None if r in named else f"rank {r}")
            named.add(r)
    ax.set_xticks(range(len(work)), list(work), fontsize=9)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    return ax.figure  # type: ignore[return-value]
