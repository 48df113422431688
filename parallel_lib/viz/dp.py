"""Pictures of data-parallel training (chapter 01): who gets which data, how fast, and drift.

Each function draws what the library produced: the partition comes from
``PartitionSampler`` (the sampler ``partition_dataset`` uses), the speed and time
plots from the ranks' :class:`~parallel_lib.training.TrainResult` records (the job's view:
:func:`~parallel_lib.training.job_record`), the drift from final states.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import matplotlib.pyplot as plt
import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from parallel_lib.data.partition import PartitionSampler
from parallel_lib.training import TrainResult, job_record
from parallel_lib.viz.ring import rank_color

__all__ = ["render_partitions", "epoch_seconds", "render_throughput", "render_breakdown", "parameter_drift",
           "render_drift"]


def render_partitions(num_examples: int = 20, world_size: int = 2, batch_size: int = 4, seed: int = 1234,
                      epochs: Sequence[int] = (0, 1)) -> Figure:
    """Which shuffled example (its index in the data set) each rank loads in each step.

    One panel per epoch; a row per rank, a column group per step. Every index
    appears once per epoch (twice at most when padding evens out the parts).
    """
    local = batch_size // world_size
    fig, axes = plt.subplots(len(epochs), 1, figsize=(0.5 * num_examples / world_size * 1.1 + 2.5,
                                                      1.0 + 0.75 * world_size * len(epochs)), squeeze=False)
    for ax, epoch in zip(axes[:, 0], epochs):
        for rank in range(world_size):
            sampler = PartitionSampler(num_examples, rank, world_size, seed)
            sampler.set_epoch(epoch)
            for j, index in enumerate(sampler.indices):
                step = j // local
                x = j + 0.3 * step  # a gap between steps
                ax.add_patch(Rectangle((x, -rank - 0.45), 0.9, 0.9, facecolor=rank_color(rank),
                                       alpha=0.35 if step % 2 else 0.7, edgecolor="black", linewidth=0.5))
                ax.text(x + 0.45, -rank, str(index), ha="center", va="center", fontsize=9)
        steps = -(-len(sampler.indices) // local)
        for step in range(steps):
            ax.text(step * (local + 0.3) + local / 2 - 0.05, 0.75, f"step {step}", ha="center", fontsize=8)
        ax.set_yticks([-r for r in range(world_size)], [f"rank {r}" for r in range(world_size)])
        ax.set_xlim(-0.2, len(sampler.indices) + 0.3 * steps)
        ax.set_ylim(-world_size + 0.4, 1.1)
        ax.set_xticks([])
        ax.set_frame_on(False)
        ax.set_title(f"epoch {epoch}: {num_examples} examples, global batch {batch_size} = "
                     f"{world_size} x {local} (seed {seed})", fontsize=10)
    fig.tight_layout()
    return fig


def epoch_seconds(results: Sequence[TrainResult], steps_per_epoch: int) -> list[float]:
    """Seconds of each epoch of the job (its slowest rank's steps, summed per ``steps_per_epoch`` steps).

    The last epoch may be cut short by the run's last step.

    Raises:
        ValueError: ``steps_per_epoch`` below 1.
    """
    if steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch must be >= 1, got steps_per_epoch={steps_per_epoch}")
    times = job_record(results).step_times
    return [sum(times[e:e + steps_per_epoch]) for e in range(0, len(times), steps_per_epoch)]


def render_throughput(runs: Mapping[str, tuple[Sequence[TrainResult], int]], title: str = "") -> Figure:
    """Tokens/s per step (left) and seconds per epoch (right) of each run, e.g. 1 vs 2 ranks.

    Args:
        runs: label -> (every rank's results of one run, the run's steps per epoch).
        title: heading, e.g. the machine.
    """
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / max(len(runs), 1)
    epochs = 0
    for i, (label, (results, steps_per_epoch)) in enumerate(runs.items()):
        record = job_record(results)  # the job's view: global target tokens over the slowest rank's time
        left.plot(range(record.steps), record.tokens_per_sec, label=label, linewidth=1)
        times = epoch_seconds(results, steps_per_epoch)
        epochs = max(epochs, len(times))
        right.bar([e + i * width for e in range(len(times))], times, width=width, label=label)
    left.set(xlabel="step", ylabel="target tokens / s", title="throughput during training")
    right.set(xlabel="epoch", ylabel="seconds (slowest rank)", title="time per epoch")
    right.set_xticks([e + width * (len(runs) - 1) / 2 for e in range(epochs)], [str(e) for e in range(epochs)])
    for ax in (left, right):
        ax.legend()
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def render_breakdown(result: TrainResult, ax: Optional[Axes] = None) -> Figure:
    """Where each step's time went on one rank: data, compute, sync, optimizer, GC (``record.phases``)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(12, 3.5))
    parts = result.record.phases
    steps = range(len(parts["data"]))
    bottom = [0.0] * len(steps)
    # gc runs inside the other phases: drawn on its own, as a marker, not stacked
    for name in ("data", "compute", "sync", "optimizer"):
        ms = [1e3 * s for s in parts[name]]
        ax.bar(steps, ms, bottom=bottom, label=name, width=1.0)
        bottom = [b + m for b, m in zip(bottom, ms)]
    gc_steps = [k for k, s in enumerate(parts["gc"]) if s > 0]
    ax.scatter(gc_steps, [bottom[k] for k in gc_steps], marker="v", color="black", zorder=3,
               label="garbage collection ran")
    ax.set(xlabel="step", ylabel="ms", title=f"rank {result.rank}, {result.plan.name}: time per step by phase")
    ax.legend(ncol=5, fontsize=8)
    return ax.figure  # type: ignore[return-value]


def parameter_drift(states: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, float]:
    """Largest relative distance ``|θ_r − θ_0| / |θ_0|`` of any rank r from rank 0, per module.

    Modules are the parameter names up to the block (``transformer.h.2``, ``transformer.wte``, ...).
    """
    def group(name: str) -> str:
        parts = name.split(".")
        return ".".join(parts[:3] if parts[1:2] == ["h"] else parts[:2])

    sums: dict[str, list[float]] = {}
    for name, reference in states[0].items():
        diff = max(float((s[name].double() - reference.double()).norm()) for s in states[1:])
        entry = sums.setdefault(group(name), [0.0, 0.0])
        entry[0] += diff**2
        entry[1] += float(reference.double().norm()) ** 2
    return {g: (d / n) ** 0.5 if n else 0.0 for g, (d, n) in sums.items()}


def render_drift(drifts: Mapping[str, Mapping[str, float]], ax: Optional[Axes] = None) -> Figure:
    """Bars of :func:`parameter_drift` per module, one colour per run (e.g. sync none vs bucketed)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3.5))
    modules = list(next(iter(drifts.values())))
    width = 0.8 / len(drifts)
    for i, (label, drift) in enumerate(drifts.items()):
        ax.bar([k + i * width for k in range(len(modules))], [drift[m] for m in modules], width=width, label=label)
    ax.set_xticks([k + width * (len(drifts) - 1) / 2 for k in range(len(modules))],
                  [m.replace("transformer.", "") for m in modules])
    ax.set(ylabel="|θ_rank − θ_0| / |θ_0|", title="how far replicas end up from rank 0's")
    ax.legend()
    return ax.figure  # type: ignore[return-value]
