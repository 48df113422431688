"""The 3D rank grid drawn: who talks to whom in DP × TP × PP (chapter 10).

Each square is a rank, labelled with its global number and its coordinates (replica d,
stage j, slice t). A grey box around neighbouring squares is a tensor-parallel group
(the heavy, frequent all-reduces); solid arrows are the pipeline's send/recv between the
same slice of neighbouring stages; dashed lines join a data-parallel group (the same slice
of the same stage in every replica: one gradient all-reduce per step).
"""

from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch, Rectangle

from parallel_lib.viz.ring import rank_color

__all__ = ["render_grid3d"]

_CELL, _GAP, _ROW = 1.0, 0.9, 1.8  # square size, gap between stages, height of a replica row


def _xy(grid: Any, d: int, j: int, t: int) -> tuple[float, float]:
    return j * (grid.tp * _CELL + _GAP) + t * _CELL, -d * _ROW


def render_grid3d(grid: Any, title: str = "") -> Figure:
    """Draw a dp x tp x pp :class:`~parallel_lib.runtime.mesh.Mesh`: ranks, tp boxes, pp arrows, dp lines."""
    if grid.cp > 1 or grid.ep > 1:
        raise ValueError(f"render_grid3d draws the dp, tp and pp axes; got a mesh with cp={grid.cp}, ep={grid.ep}")
    fig, ax = plt.subplots(figsize=(1.2 + 1.3 * grid.pp * grid.tp + 0.6 * grid.pp, 0.9 + 1.5 * grid.dp))
    ranks = grid.ranks[:, :, 0, 0, :]  # [dp, pp, tp]
    for d in range(grid.dp):
        for j in range(grid.pp):
            x0, y0 = _xy(grid, d, j, 0)
            ax.add_patch(FancyBboxPatch((x0 - 0.06, y0 - 0.06), grid.tp * _CELL + 0.02, _CELL + 0.02,
                                        boxstyle="round,pad=0.04", facecolor="whitesmoke", edgecolor="dimgrey",
                                        linewidth=1.2, zorder=0))
            for t in range(grid.tp):
                x, y = _xy(grid, d, j, t)
                rank = int(ranks[d, j, t])
                ax.add_patch(Rectangle((x + 0.05, y + 0.05), _CELL - 0.2, _CELL - 0.2, facecolor=rank_color(j),
                                       alpha=0.35 + 0.5 * t / max(1, grid.tp - 1), edgecolor="black", zorder=1))
                ax.text(x + _CELL / 2 - 0.05, y + 0.58, f"{rank}", ha="center", va="center", fontsize=12,
                        fontweight="bold", zorder=2)
                ax.text(x + _CELL / 2 - 0.05, y + 0.25, f"({d},{j},{t})", ha="center", va="center", fontsize=7,
                        zorder=2)
                if j + 1 < grid.pp:  # the pipeline: to the same slice of the next stage
                    nx, _ = _xy(grid, d, j + 1, t)
                    # under the boxes, so slice t's arrow lands on slice t, not on a neighbour
                    ax.annotate("", xy=(nx + 0.4, y + 0.05), xytext=(x + 0.4, y + 0.05),
                                arrowprops=dict(arrowstyle="->", color="tab:blue", lw=1.0,
                                                connectionstyle=f"arc3,rad={0.25 + 0.1 * t}"), zorder=3)
                if d + 1 < grid.dp:  # data parallelism: the same (j, t) one replica down
                    ax.plot([x + 0.2 + 0.1 * t] * 2, [y + 0.05, y - _ROW + _CELL - 0.15], linestyle="--",
                            color="tab:red", lw=1.0, zorder=0.5)
        ax.text(-0.35, -d * _ROW + _CELL / 2, f"replica {d}", ha="right", va="center", fontsize=9)
    for j in range(grid.pp):
        x0, _ = _xy(grid, 0, j, 0)
        ax.text(x0 + grid.tp * _CELL / 2 - 0.05, _CELL + 0.25, f"stage {j}", ha="center", fontsize=9)
    width = grid.pp * (grid.tp * _CELL + _GAP)
    ax.set_xlim(-1.6, width)
    ax.set_ylim(-(grid.dp - 1) * _ROW - 0.7, _CELL + 0.7)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.plot([], [], color="dimgrey", lw=3, label=f"tensor-parallel group ({grid.tp} ranks)")
    ax.plot([], [], color="tab:blue", lw=1, label="pipeline send/recv")
    ax.plot([], [], color="tab:red", lw=1, linestyle="--", label=f"data-parallel group ({grid.dp} ranks)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=3, fontsize=8, frameon=False)
    ax.set_title(title or f"dp={grid.dp} x tp={grid.tp} x pp={grid.pp}: rank (replica, stage, slice), "
                          f"order {grid.short_order}", fontsize=10)
    return fig
