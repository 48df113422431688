"""Pictures of serving (chapter 09): request timelines, latency against throughput, the roofline, a calculator.

Everything drawn comes from the library: the engine's own events (:class:`~parallel_lib.inference.ServeRun`),
the benchmark's measurements, :mod:`parallel_lib.inference.cost_model` and
:mod:`parallel_lib.inference.serving_memory`. The widget redraws :func:`calculator_figure`, which is
also the static image under ``figures/``.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from parallel_lib.inference.cost_model import GPUS, Hardware, Workload, pareto_front, predict
from parallel_lib.inference.serving_memory import serving_memory
from parallel_lib.model_parallel.memory import GiB
from parallel_lib.viz.timeline import plot_timeline
from parallel_lib.viz.widgets import figure_panel

__all__ = ["plot_request_timelines", "plot_latency_throughput", "plot_roofline", "calculator_figure",
           "serving_calculator", "MODELS", "STRATEGY_COLORS"]

STRATEGY_COLORS = {"single": "#333333", "dp": "#4C72B0", "mp": "#DD8452", "pp": "#55A868", "tp": "#C44E52"}
MODELS = ("llama-2-7b", "llama-2-13b", "llama-2-70b", "gpt2-xl (1.5B)")


def plot_request_timelines(runs: Mapping[str, Any], unit: str = "ms") -> Figure:
    """One Gantt chart per run (title -> :class:`ServeRun`): a lane per device or rank and per request.

    Device lanes show which device computed which group's prefill or decode step; request lanes show
    when each request got each token. Drawn by the course's one timeline function.
    """
    rows = [len({e.lane for e in run.events}) for run in runs.values()]
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, sum(0.35 * r + 0.9 for r in rows)), squeeze=False,
                             gridspec_kw=dict(height_ratios=[r + 2 for r in rows]))
    for ax, (title, run) in zip(axes[:, 0], runs.items()):
        events = run.events
        devices = sorted({e.lane for e in events if not e.lane.startswith("request")})
        requests = sorted({e.lane for e in events if e.lane.startswith("request")}, key=lambda s: int(s.split()[1]))
        plot_timeline(events, ax=ax, title=title, lanes=devices + requests, unit=unit, show_bubble=False)
    fig.tight_layout()
    return fig


def plot_latency_throughput(points: Sequence[Mapping[str, Any]],
                            predicted: Optional[Sequence[Mapping[str, Any]]] = None, title: str = "") -> Figure:
    """Time per output token against aggregate tokens/s, one dot per (strategy, ranks, concurrency).

    ``points`` are dicts with ``strategy``, ``ranks``, ``concurrency``, ``tpot`` (s) and ``tokens_per_second``;
    the Pareto front (nothing both faster per token and higher in throughput) is the black line;
    ``predicted`` points, drawn hollow, come from the cost model.
    """
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for series, hollow in ((points, False), (predicted or [], True)):
        for p in series:
            color = STRATEGY_COLORS.get(p["strategy"], "grey")
            ax.scatter(p["tokens_per_second"], p["tpot"] * 1e3, s=20 + 8 * p["concurrency"],
                       facecolors="none" if hollow else color, edgecolors=color, alpha=0.6 if hollow else 0.9)
            if not hollow:
                ax.annotate(str(p["concurrency"]), (p["tokens_per_second"], p["tpot"] * 1e3), fontsize=7,
                            xytext=(3, 3), textcoords="offset points")
    front = pareto_front([(p["tpot"], p["tokens_per_second"]) for p in points])
    ax.plot([points[i]["tokens_per_second"] for i in front], [points[i]["tpot"] * 1e3 for i in front], "k-",
            lw=1, label="Pareto front (measured)")
    for name, color in STRATEGY_COLORS.items():
        if any(p["strategy"] == name for p in points):
            ax.scatter([], [], color=color, label=name)
    if predicted:
        ax.scatter([], [], facecolors="none", edgecolors="grey", label="predicted (cost model)")
    ax.set(xscale="log", yscale="log", xlabel="aggregate tokens/s (higher is better)",
           ylabel="ms per output token (lower is better)", title=title or "latency vs throughput; labels: concurrency")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_roofline(flops_per_second: float, bytes_per_second: float, points: Mapping[str, tuple[float, float]],
                  title: str = "") -> Figure:
    """The roofline ``min(rate, intensity × bandwidth)`` and work placed on it.

    ``points`` maps a label to ``(FLOPs per byte, achieved FLOP/s)``; a point under the sloped part is
    memory-bound, under the flat part compute-bound.
    """
    ridge = flops_per_second / bytes_per_second
    xs = [ridge / 1000 * 10 ** (k / 10) for k in range(0, 61)]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    ax.plot(xs, [min(flops_per_second, x * bytes_per_second) for x in xs], "k-", lw=1.5, label="roofline")
    ax.axvline(ridge, color="grey", ls=":", lw=1)
    ax.text(ridge, flops_per_second * 1.15, f"ridge {ridge:.1f} FLOP/byte", ha="center", fontsize=8)
    for i, (label, (intensity, rate)) in enumerate(points.items()):
        ax.scatter(intensity, rate, color=plt.get_cmap("tab10")(i), zorder=3, label=label)
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOPs per byte read)", ylabel="FLOP/s",
           title=title)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return fig


def calculator_figure(model: str = "llama-2-7b", gpu: str = "A100 80GB (published)", strategy: str = "tp",
                      n_devices: int = 2, concurrency: int = 8, prompt: int = 2048, new_tokens: int = 256) -> Figure:
    """The widget's picture: memory per device (weights + KV cache) and the cost model's latency and throughput.

    Left: the fullest device's bytes for every strategy against the card's memory; right: TPOT and tokens/s
    per strategy, the chosen one outlined. Published GPU figures, not measurements.
    """
    hw: Hardware = GPUS[gpu]
    w = Workload(prompt, new_tokens, concurrency, "fp16")
    options = [("single", 1)] + [(s, n_devices) for s in ("dp", "mp", "pp", "tp")] if n_devices > 1 else [("single", 1)]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    for x, (name, n) in enumerate(options):
        memory = serving_memory(model, name, n, "fp16")
        totals = memory.total_bytes(concurrency, prompt + new_tokens)
        d = max(range(n), key=lambda i: totals[i])
        chosen = name == strategy or (n == 1 and strategy == "single")
        edge = dict(edgecolor="black", linewidth=2) if chosen else dict(edgecolor="white")
        ax.bar(x, memory.weights[d] / GiB, 0.6, color="#4C72B0", label="weights" if x == 0 else None, **edge)
        ax.bar(x, (totals[d] - memory.weights[d]) / GiB, 0.6, bottom=memory.weights[d] / GiB, color="#DD8452",
               label="KV cache" if x == 0 else None, **edge)
        p = predict(model, name, n, w, hw)
        ax2.bar(x - 0.2, p.tpot * 1e3, 0.4, color=STRATEGY_COLORS[name], **edge)
        ax2.text(x - 0.2, p.tpot * 1e3, f"{p.tpot * 1e3:.1f}", ha="center", va="bottom", fontsize=7)
        ax3 = ax2.twinx() if x == 0 else ax3
        ax3.bar(x + 0.2, p.tokens_per_second, 0.4, color=STRATEGY_COLORS[name], alpha=0.4, hatch="//", **edge)
        ax3.text(x + 0.2, p.tokens_per_second, f"{p.tokens_per_second:,.0f}", ha="center", va="bottom", fontsize=7)
    labels = [f"{name}\n×{n}" for name, n in options]
    ax.axhline(hw.memory_bytes / GiB, color="red", ls="--", lw=1, label=f"{hw.name}: {hw.memory_bytes / GiB:.0f} GiB")
    ax.set_xticks(range(len(options)), labels)
    ax.set(ylabel="GiB on the fullest device",
           title=f"{model}, fp16, {concurrency} requests × {prompt + new_tokens} tokens")
    ax.legend(fontsize=8)
    ax2.set_xticks(range(len(options)), labels)
    ax2.set(ylabel="ms per output token (solid)", title=f"cost model on {gpu}")
    ax3.set_ylabel("tokens/s, all requests (hatched)")
    fig.tight_layout()
    return fig


def serving_calculator() -> Any:
    """An ipywidgets panel: model, GPU (published figures), strategy, devices, requests -> memory, time, throughput."""
    import ipywidgets as widgets

    controls = dict(
        model=widgets.Dropdown(options=list(MODELS), value="llama-2-7b", description="model"),
        gpu=widgets.Dropdown(options=list(GPUS), value="A100 80GB (published)", description="GPU"),
        strategy=widgets.Dropdown(options=["single", "dp", "mp", "pp", "tp"], value="tp", description="strategy"),
        n_devices=widgets.Dropdown(options=[2, 4, 8], value=2, description="devices"),
        concurrency=widgets.IntSlider(value=8, min=1, max=128, description="requests"),
        prompt=widgets.IntSlider(value=2048, min=128, max=4096, step=128, description="prompt"))
    return figure_panel(calculator_figure, controls)
