"""Expert parallelism drawn from a run's own routing record: tokens through the all-to-all, and the load over training.

:func:`replay_dispatch` turns what every rank routed in one forward (the ``experts`` and ``kept`` of
its :class:`~parallel_lib.expert_parallel.moe.RoutingRecord`) into the rows each rank sends and
receives, with :func:`~parallel_lib.expert_parallel.dispatch_plan.dispatch_plan`, the same order
the layer uses. :func:`render_dispatch` draws one stage of that forward (a pure function: records,
frame -> figure); :func:`dispatch_widget` steps through the stages; :func:`plot_imbalance` draws the
tokens per expert and per rank that :func:`~parallel_lib.expert_parallel.routing_log.log_routing`
measured. Only drawing happens here; the runs are launched by the notebook or ``figures``.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import matplotlib.pyplot as plt
import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from parallel_lib.common.checks import check_int
from parallel_lib.expert_parallel.balance import imbalance
from parallel_lib.expert_parallel.dispatch_plan import dispatch_plan

__all__ = ["FRAMES", "replay_dispatch", "render_dispatch", "render_dispatch_grid", "dispatch_widget",
           "plot_imbalance"]

FRAMES = ("each rank routes its own tokens: top-k experts, capacity drops the rest (crossed)",
          "[2] sorted by expert into one send buffer, split by destination rank; [3] the counts are exchanged",
          "[4] all-to-all: every rank sends each rank the rows for its experts (uneven splits)",
          "[5] each expert computes the rows it received, from every rank",
          "[6] reverse all-to-all; [7] each token sums its experts' rows, weighted by the router")
_ROW = 0.26          # height of one row
_X = dict(tokens=0.0, send=3.2, receive=6.6, experts=9.6)
_W = 1.6             # width of a buffer's rows


def _color(expert: int) -> Any:
    return plt.get_cmap("tab10")(expert % 10)


def replay_dispatch(records: Sequence[Mapping[str, Any]], n_experts: int) -> list[dict[str, Any]]:
    """Per rank: its tokens' choices, the rows it sends (in order) and the rows it receives, from every rank's record.

    Args:
        records: per rank, in rank order, a mapping with ``experts`` and ``kept`` (T, k) (and ``weights``).
        n_experts: E.

    Returns:
        Per rank: ``experts``, ``kept``, ``weights``, ``sent`` [(token, slot, expert, to rank)],
        ``send`` (rows per rank), ``received`` [(from rank, token, slot, expert)].
    """
    ep = len(records)
    plans = [dispatch_plan(torch.as_tensor(r["experts"]), torch.as_tensor(r["kept"]), n_experts, ep) for r in records]
    local = n_experts // ep
    out = []
    for rank, (r, plan) in enumerate(zip(records, plans)):
        sent = [(int(t), int(s), int(e), int(e) // local) for t, s, e in zip(plan.token, plan.slot, plan.expert)]
        out.append(dict(experts=torch.as_tensor(r["experts"]), kept=torch.as_tensor(r["kept"]),
                        weights=torch.as_tensor(r["weights"]) if "weights" in r else None, sent=sent, send=plan.send))
    for rank in range(ep):  # what the all-to-all delivers: grouped by source rank, by expert within
        out[rank]["received"] = [(src, t, s, e) for src in range(ep) for t, s, e, to in out[src]["sent"] if to == rank]
    return out


def _bracket(ax: Axes, x: float, y0: float, y1: float, text: str) -> None:
    ax.plot([x, x + 0.08, x + 0.08, x], [y0, y0, y1, y1], color="black", linewidth=0.8)
    ax.text(x + 0.12, (y0 + y1) / 2, text, va="center", fontsize=7)


def render_dispatch(records: Sequence[Mapping[str, Any]], n_experts: int, frame: int,
                    ax: Optional[Axes] = None, title: Optional[str] = None) -> Figure:
    """Draw stage ``frame`` (0 .. len(FRAMES) - 1) of one expert-parallel forward, replayed from ``records``.

    Each rank is a band: its tokens with their choices (coloured by expert), its send buffer split by
    destination, its receive buffer grouped by source, and its experts with the rows they computed.

    Raises:
        ValueError: ``frame`` outside 0 .. len(FRAMES) - 1.
    """
    check_int("frame", frame, 0, len(FRAMES) - 1)
    ranks = replay_dispatch(records, n_experts)
    ep, local = len(ranks), n_experts // len(ranks)
    tokens, k = ranks[0]["experts"].shape
    band = max(tokens, max(len(r["sent"]) for r in ranks), max(len(r["received"]) for r in ranks)) * _ROW + 0.9
    if ax is None:
        _, ax = plt.subplots(figsize=(11.5, 1.0 + 2.3 * band * ep / 4))
    top = {rank: -rank * band for rank in range(ep)}

    def row_y(rank: int, i: int) -> float:
        return top[rank] - 0.55 - (i + 1) * _ROW

    sent_y, recv_y = {}, {}
    for rank, r in enumerate(ranks):
        y0 = top[rank]
        ax.text(-0.3, y0 - 0.15, f"rank {rank}  (experts {rank * local}..{(rank + 1) * local - 1})",
                fontsize=10, fontweight="bold", va="top")
        for t in range(tokens):  # [1] the tokens and their choices
            y = row_y(rank, t)
            ax.text(_X["tokens"] + 0.45, y + _ROW / 2, f"t{t}", ha="right", va="center", fontsize=7)
            for j in range(k):
                e, kept = int(r["experts"][t, j]), bool(r["kept"][t, j])
                x = _X["tokens"] + 0.55 + j * 0.62
                ax.add_patch(Rectangle((x, y), 0.58, _ROW * 0.9, facecolor=_color(e) if kept else "#dddddd",
                                       edgecolor="black", linewidth=0.4))
                label = f"e{e}" if not (frame == 4 and kept and r["weights"] is not None) else \
                    f"{float(r['weights'][t, j]):.2f}"
                ax.text(x + 0.29, y + _ROW * 0.45, label, ha="center", va="center", fontsize=6.5)
                if not kept:
                    ax.plot([x, x + 0.58], [y, y + _ROW * 0.9], color="#C44E52", linewidth=1.2)
        if frame >= 1:  # [2] the send buffer, split by destination
            start = 0
            for i, (t, s, e, to) in enumerate(r["sent"]):
                y = row_y(rank, i)
                sent_y[(rank, t, s)] = y
                ax.add_patch(Rectangle((_X["send"], y), _W, _ROW * 0.9, facecolor=_color(e), edgecolor="black",
                                       linewidth=0.4))
                ax.text(_X["send"] + _W / 2, y + _ROW * 0.45, f"t{t} → e{e}", ha="center", va="center", fontsize=6.5)
            for to, n in enumerate(r["send"]):
                if n:
                    _bracket(ax, _X["send"] + _W + 0.05, row_y(rank, start) + _ROW, row_y(rank, start + n - 1),
                             f"{n} to rank {to}")
                start += n
            ax.text(_X["send"], y0 - 0.35, f"send {r['send']}", fontsize=8, va="top")
        if frame >= 2:  # [4] the receive buffer, grouped by source
            for i, (src, t, s, e) in enumerate(r["received"]):
                y = row_y(rank, i)
                recv_y[(src, t, s)] = y
                ax.add_patch(Rectangle((_X["receive"], y), _W, _ROW * 0.9, facecolor=_color(e), edgecolor="black",
                                       linewidth=0.4))
                ax.text(_X["receive"] + _W / 2, y + _ROW * 0.45, f"r{src}.t{t} → e{e}", ha="center", va="center",
                        fontsize=6.5)
            received = [sum(src == s for s, *_ in r["received"]) for s in range(ep)]
            ax.text(_X["receive"], y0 - 0.35, f"receive {received}", fontsize=8, va="top")
        if frame >= 3:  # [5] the experts
            for j in range(local):
                e = rank * local + j
                n = sum(row[3] == e for row in r["received"])
                y = top[rank] - 0.6 - (j + 0.5) * band / (local + 0.5)
                ax.add_patch(Rectangle((_X["experts"], y), 1.6, band / (local + 1.5), facecolor=_color(e), alpha=0.8,
                                       edgecolor="black"))
                ax.text(_X["experts"] + 0.8, y + band / (local + 1.5) / 2, f"expert {e}\n{n} rows", ha="center",
                        va="center", fontsize=8)
    if frame in (2, 4):  # the all-to-all's arrows: forward (2) or back (4), one per row
        for (src, t, s), y_to in recv_y.items():
            y_from = sent_y[(src, t, s)]
            a, b = (_X["send"] + _W, y_from + _ROW / 2), (_X["receive"], y_to + _ROW / 2)
            ax.add_patch(FancyArrowPatch(*(a, b) if frame == 2 else (b, a), arrowstyle="-|>", mutation_scale=7,
                                         linewidth=0.6, color="#4C72B0" if frame == 2 else "#55A868", alpha=0.7))
    ax.set_xlim(-0.4, 11.6)
    ax.set_ylim(-ep * band - 0.1, 0.1)
    ax.axis("off")
    ax.set_title(title if title is not None else f"stage {frame + 1}/{len(FRAMES)}: {FRAMES[frame]}", fontsize=9,
                 loc="left")
    return ax.figure  # type: ignore[return-value]


def render_dispatch_grid(records: Sequence[Mapping[str, Any]], n_experts: int, title: str = "") -> Figure:
    """Stages 2 to 5 of :func:`render_dispatch` in a 2 × 2 grid: the widget on paper."""
    fig, axes = plt.subplots(2, 2, figsize=(22, 12))
    for frame, ax in zip(range(1, len(FRAMES)), axes.flat):
        render_dispatch(records, n_experts, frame, ax=ax)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def dispatch_widget(records: Sequence[Mapping[str, Any]], n_experts: int) -> Any:
    """Play and a stage slider over :func:`render_dispatch`; returns an ``ipywidgets.VBox`` (caption is child 1)."""
    import ipywidgets as w  # imported here: the library runs without a notebook
    from IPython.display import display

    play = w.Play(value=0, min=0, max=len(FRAMES) - 1, step=1, interval=1800, description="play")
    stage = w.IntSlider(value=0, min=0, max=len(FRAMES) - 1, description="stage")
    w.jslink((play, "value"), (stage, "value"))
    caption, output = w.HTML(), w.Output()

    def redraw(_: Any = None) -> None:
        caption.value = f"stage {stage.value + 1}/{len(FRAMES)}: {FRAMES[stage.value]}"
        with output:
            output.clear_output(wait=True)
            fig = render_dispatch(records, n_experts, stage.value)
            display(fig)
            plt.close(fig)  # one figure per stage, not one more each time the slider moves

    stage.observe(redraw, names="value")
    redraw()
    return w.VBox([w.HBox([play, stage]), caption, output])


def plot_imbalance(logs: Mapping[float, Sequence[Mapping[str, Any]]], title: str = "") -> Figure:
    """Busiest expert over the mean per step, and busiest rank over the mean (each the mean over layers).

    Args:
        logs: balancing loss weight α -> every rank's :func:`~parallel_lib.expert_parallel.routing_log.log_routing`.
        title: the figure's heading (name the machine for measured runs).
    """
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    for n, (alpha, ranks) in enumerate(sorted(logs.items())):
        steps, layers = len(ranks[0]["routed"]), len(ranks[0]["routed"][0])
        per_step = [sum(imbalance(torch.tensor([log["routed"][s][layer] for log in ranks]).sum(0))
                        for layer in range(layers)) / layers for s in range(steps)]
        left.plot(range(1, steps + 1), per_step, marker="o", color=f"C{n}", label=f"α = {alpha:g}")
        per_rank = [sum(imbalance(torch.tensor([log["received"][s][layer] for log in ranks]))
                        for layer in range(layers)) / layers for s in range(steps)]
        right.plot(range(1, steps + 1), per_rank, marker="s", color=f"C{n}", label=f"α = {alpha:g}")
    n_experts = len(next(iter(logs.values()))[0]["routed"][0][0])
    left.axhline(1.0, color="grey", linewidth=0.8)
    left.axhline(n_experts, color="grey", linewidth=0.8, linestyle=":")
    left.set_ylim(0.8, n_experts + 0.2)
    left.set_xlabel("training step")
    left.set_ylabel("busiest expert's tokens / mean")
    left.set_title(f"1 = balanced, {n_experts} = every token to one expert", fontsize=9)
    right.set_xlabel("training step")
    right.set_ylabel("busiest rank's rows / mean")
    right.set_title(f"{len(next(iter(logs.values())))} ranks: every all-to-all waits for the busiest", fontsize=9)
    right.axhline(1.0, color="grey", linewidth=0.8)
    for ax in (left, right):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
