"""Tensor-parallel benchmark: ``python -m parallel_lib.bench tp [--quick] [--max-tp 4]``.

One run prints three tables:

1. **step time vs tp**, for GPT-2 "small" and the 124M shape (vocabulary 50,304: GPT-2's
   50,257 padded to a multiple of 128, as Megatron and nanoGPT do): the course's split,
   with sequence parallelism, and PyTorch's DTensor ``parallelize_module``; per rank the
   parameter bytes, the activation bytes saved for backward, the bytes sent per step
   (counted), and the α–β model's predicted step time beside the measured one;
2. **the crossover**: a 2-layer GPT-2 swept in width, tp = 1 vs 2, measured and predicted:
   the width at which splitting starts to pay on this machine;
3. **the same model on NVLink**: the crossover the model predicts for H100s (labelled a
   prediction: nothing here ran on a GPU).

tp = 1 is measured in the same launch as tp = 2, one dense step on rank 0 before every split step
(:func:`~parallel_lib.bench._tp_runs.timed_steps`), so both see the same load. Beside each step's wall
time the tables give its CPU time (the work) and, for the split steps, the time in collectives split
into the wait for the other rank and the transfer after it arrived: on a shared 2-core machine the
wait, not the wire, is what separates measurement from model.

The α–β constants are fitted twice in the same run: to an all-reduce repeated in isolation (the
chapter 02 way), and to the all-reduces the split steps really ran (their transfer times by size);
the predictions use the second. The compute rate is the tp = 1 run's FLOPs (``training_flops``) over
its step time.
"""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch

from parallel_lib.bench._tp_runs import IMPLEMENTATIONS, Run, measure_all
from parallel_lib.common.models import gpt2_config
from parallel_lib.common.tables import markdown_table
from parallel_lib.cost.alpha_beta import hops, ring_wire_bytes
from parallel_lib.cost.shape import GPTShape
from parallel_lib.runtime.environment import machine_label
from parallel_lib.runtime.launcher import launch
from parallel_lib.tensor_parallel.cost import (NVLINK_H100, collective_seconds, crossover_width, step_collectives,
                                                step_seconds, training_flops)

__all__ = ["Config", "QUICK", "SWEEP", "Results", "in_step_fit", "measure", "sweep_series", "markdown", "main"]

H100_FLOPS = 400e12  # bf16, about 40% of the datasheet's 989 TFLOP/s dense: a typical achieved rate (assumption)


@dataclass(frozen=True)
class Config:
    """What is measured and how often."""

    models: tuple[str, ...] = ("small", "gpt2")
    vocab_size: int = 50304
    batch_size: int = 2
    seq_len: int = 128
    max_tp: int = 2
    steps: int = 4                 # per GPT-2 variant: the 124M shape takes seconds per step on a CPU
    warmup: int = 1
    sweep_widths: tuple[int, ...] = (64, 128, 256, 512, 1024)
    sweep_steps: int = 8           # the sweep's models are small: more steps, a steadier median
    sweep_warmup: int = 2
    sweep_layers: int = 2
    sweep_vocab: int = 1024
    timeout: float = 1200.0


QUICK = Config(models=("tiny",), vocab_size=256, batch_size=2, seq_len=16, steps=2, warmup=1,
               sweep_widths=(64, 128), sweep_steps=2, sweep_warmup=1, timeout=300.0)


# only the width sweep, small enough for a notebook cell or a figure (about half a minute on 2 cores)
SWEEP = Config(models=(), batch_size=2, seq_len=64, sweep_widths=(64, 128, 256, 512), sweep_steps=4, sweep_warmup=1,
               timeout=300.0)


@dataclass
class Results:
    """Measured runs keyed by (model, tp, implementation), the sweep, and the fitted constants.

    ``bandwidth``/``latency`` are fitted to an all-reduce repeated alone, ``step_bandwidth``/``step_latency``
    to the all-reduces inside the split steps (:func:`in_step_fit`; 0: not measured, the isolated fit is used).
    """

    config: Config
    machine: str
    bandwidth: float
    latency: float
    runs: dict[tuple[str, int, str], Run] = field(default_factory=dict)
    sweep: dict[tuple[int, int], float] = field(default_factory=dict)  # (width, tp) -> seconds
    sweep_runs: dict[tuple[int, int], Run] = field(default_factory=dict)  # (width, tp) -> the whole run
    step_bandwidth: float = 0.0
    step_latency: float = 0.0
    load: tuple[float, float] = (0.0, 0.0)  # the 1-minute load average before and after the run

    def alpha_beta(self) -> tuple[float, float]:
        """``(bandwidth, latency)`` the predictions use: the in-step fit when there is one."""
        return (self.step_bandwidth, self.step_latency) if self.step_bandwidth > 0 else (self.bandwidth, self.latency)


def _shape(name: str, vocab: int, **overrides: Any) -> GPTShape:
    return GPTShape.of(gpt2_config(name, vocab, **overrides))


def _sweep_overrides(width: int, c: Config) -> dict[str, Any]:
    return dict(n_embd=width, n_head=max(2, width // 64), n_layer=c.sweep_layers)


def in_step_fit(runs: list[Run], tp: int, bandwidth: float) -> Optional[tuple[float, float]]:
    """``(bandwidth, latency)`` of the all-reduces inside ``runs``' steps: least squares of ``hops·α + wire/β``.

    Each all-reduce's time in the call, the wait for the other ranks included (a step pays it). When the
    calls hold fewer than two sizes, or their times do not grow with size, ``bandwidth`` (fitted alone)
    is kept and α is the median of each call's time less its bytes over it. None when ``runs`` timed no
    all-reduce.
    """
    calls = [(ring_wire_bytes("all_reduce", nbytes, tp), in_call) for run in runs
             for kind, nbytes, _, in_call in run.collectives if kind == "all_reduce"]
    if not calls or bandwidth <= 0:
        return None
    steps = hops("all_reduce", tp)
    if len({wire for wire, _ in calls}) >= 2:
        design = torch.tensor([[wire, float(steps)] for wire, _ in calls], dtype=torch.float64)
        seconds = torch.tensor([[t] for _, t in calls], dtype=torch.float64)
        slope, alpha = torch.linalg.lstsq(design, seconds).solution[:, 0].tolist()
        if slope > 1e-13 and alpha >= 0:
            return 1.0 / slope, alpha
    return bandwidth, max(0.0, statistics.median((t - wire / bandwidth) / steps for wire, t in calls))


def measure(config: Config = Config()) -> Results:
    """Run every variant, one launch per tensor-parallel size, and fit the all-reduce; see the module docstring.

    Every rank uses one intra-op thread, so tp ranks use tp cores: on a CPU, "devices" are cores. The
    tp = 1 rows come from the tp = 2 launch: one dense step on rank 0 before each split step.

    Raises:
        ValueError: ``max_tp`` below 2, or ``steps <= warmup``.
    """
    if config.max_tp < 2 or config.steps <= config.warmup or config.sweep_steps <= config.sweep_warmup:
        raise ValueError(f"need max_tp >= 2 and steps > warmup, got max_tp={config.max_tp}, steps={config.steps}, "
                         f"warmup={config.warmup}, sweep_steps={config.sweep_steps}, sweep_warmup={config.sweep_warmup}")
    c, fitted = config, (0.0, 0.0)
    load_before = os.getloadavg()[0]
    runs: dict[tuple[str, int, str], Run] = {}
    sweep_runs: dict[tuple[int, int], Run] = {}
    in_step: list[Run] = []
    for tp in [t for t in (2, 4) if t <= c.max_tp]:
        keys = [(name, tp, impl) for name in c.models for impl in IMPLEMENTATIONS]
        jobs = [(impl, name, c.vocab_size, {}, c.steps, c.warmup, tp == 2 and impl == "course")
                for name, _, impl in keys]
        widths = list(c.sweep_widths) if tp == 2 else []
        jobs += [("course", "tiny", c.sweep_vocab, _sweep_overrides(w, c), c.sweep_steps, c.sweep_warmup, True)
                 for w in widths]
        measured, fit = launch(measure_all, tp, jobs, c.batch_size, c.seq_len, tp == 2,
                               backend="gloo", timeout=c.timeout, threads_per_rank=1)[0]
        fitted = fit or fitted
        for key, (run, dense) in zip(keys, measured):
            runs[key] = run
            if dense is not None:
                runs[(key[0], 1, "course")] = dense
            if key[2] == "course" and tp == 2:
                in_step.append(run)
        for w, (run, dense) in zip(widths, measured[len(keys):]):
            sweep_runs[(w, 2)], sweep_runs[(w, 1)] = run, dense
            in_step.append(run)
    # the sweep's own calls for the sweep (a short step is preempted less), else the models'
    fit = in_step_fit([r for (_, tp), r in sweep_runs.items() if tp == 2] or in_step, 2, fitted[0])
    runs = dict(sorted(runs.items(), key=lambda kv: (kv[0][1] > 1, kv[0][1])))  # the dense rows first
    return Results(c, machine_label(), fitted[0], fitted[1], runs, {k: r.step_seconds for k, r in sweep_runs.items()},
                   sweep_runs, *(fit or (0.0, 0.0)),
                   (load_before, os.getloadavg()[0]))


def _rate(results: Results, shape: GPTShape, seconds: float) -> float:
    c = results.config
    return training_flops(shape, c.batch_size, c.seq_len) / seconds


def sweep_series(results: Results) -> tuple[list[int], dict[int, list[float]], dict[int, list[float]]]:
    """``(widths, {tp: measured seconds}, {tp: α–β predicted seconds})`` of the width sweep, for plotting."""
    c = results.config
    bw, lat = results.alpha_beta()
    widths = sorted({w for w, _ in results.sweep})
    shapes = [_shape("tiny", c.sweep_vocab, **_sweep_overrides(w, c)) for w in widths]
    rate = _rate(results, shapes[-1], results.sweep[(widths[-1], 1)])
    measured = {tp: [results.sweep[(w, tp)] for w in widths] for tp in (1, 2)}
    predicted = {tp: [step_seconds(s, c.batch_size, c.seq_len, tp, rate, bw, lat)["total"] for s in shapes]
                 for tp in (1, 2)}
    return widths, measured, predicted


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}"


def _where_time_goes(results: Results, label: str, shape: GPTShape, run: Run, sp: bool, tp: int) -> list[str]:
    """One row: a step's wall time, CPU time, wait for the other rank, transfer; the collectives predicted."""
    c, (bw, lat) = results.config, results.alpha_beta()
    collectives = step_collectives(shape, c.batch_size, c.seq_len, tp, sp)
    off = max(0.0, run.step_seconds - run.cpu_seconds - run.wait_seconds - run.transfer_seconds)
    timed = [_ms(run.wait_seconds), _ms(run.transfer_seconds), _ms(off), str(len(run.collectives))] \
        if run.collectives or tp == 1 else ["not timed"] * 4  # DTensor's functional collectives
    return [label, _ms(run.step_seconds), _ms(run.cpu_seconds), *timed,
            _ms(collective_seconds(collectives, tp, results.bandwidth, results.latency)),
            _ms(collective_seconds(collectives, tp, bw, lat))]


def markdown(results: Results) -> str:
    """The three tables, labelled with the machine, the load and the fitted constants."""
    c = results.config
    bw, lat = results.alpha_beta()
    tokens = c.batch_size * c.seq_len
    rows = []
    for (name, tp, impl), run in results.runs.items():
        shape = _shape(name, c.vocab_size)
        rate = _rate(results, shape, results.runs[(name, 1, "course")].step_seconds)
        sp = impl == "course+SP"
        predicted = step_seconds(shape, c.batch_size, c.seq_len, tp, rate, bw, lat, sp)["total"]
        # DTensor's functional collectives are counted too (runtime.collectives sees them as CommDebugMode does)
        sent = f"{run.wire_bytes / 1e6:,.2f}"
        rows.append([name, tp, impl if tp > 1 else "1 rank (dense)", f"{run.step_seconds * 1e3:,.0f}",
                     f"{tokens / run.step_seconds:,.0f}", f"{predicted * 1e3:,.0f}", f"{run.parameter_bytes / 1e6:,.1f}",
                     f"{run.activation_bytes / 1e6:,.1f}", sent])
    in_step = (f"; fitted to the all-reduces inside the sweep's split steps (waiting for the other rank "
               f"included): {results.step_bandwidth / 1e9:.2f} GB/s, {results.step_latency * 1e6:,.0f} µs per ring "
               f"step, which the predictions use") if results.step_bandwidth else ""
    load = (f", load average {results.load[0]:.1f} before and {results.load[1]:.1f} after"
            if any(results.load) else "")
    counts = sorted({r.threads for r in [*results.runs.values(), *results.sweep_runs.values()] if r.threads})
    threads = (f"{counts[0]} intra-op thread{'s' if counts[0] > 1 else ''}" if len(counts) == 1 else
               f"{counts} intra-op threads" if counts else "one intra-op thread")
    out = [f"Tensor parallelism on {results.machine}{load}: batch {c.batch_size} x {c.seq_len} tokens, AdamW, fp32, "
           f"median of {c.steps - c.warmup} steps ({c.sweep_steps - c.sweep_warmup} in the sweep), tp = 1 stepped "
           f"beside tp = 2 in one launch, {threads} per rank (torch.get_num_threads(), read in every rank); "
           f"gloo all-reduce fitted alone to bandwidth {results.bandwidth / 1e9:.2f} GB/s, "
           f"latency {results.latency * 1e6:.0f} µs per ring step{in_step}", "",
           markdown_table(["model", "tp", "implementation", "step ms", "tokens/s", "predicted ms (α–β)",
                           "params MB/rank", "activations MB/rank", "sent MB/step/rank"], rows)]
    profile = [_where_time_goes(results, f"{name} {impl if tp > 1 else 'dense (tp = 1)'}", _shape(name, c.vocab_size),
                                run, impl == "course+SP", tp)
               for (name, tp, impl), run in results.runs.items() if tp <= 2 and run.cpu_seconds]
    widths = sorted({w for w, _ in results.sweep})
    shape_of = {w: _shape("tiny", c.sweep_vocab, **_sweep_overrides(w, c)) for w in widths}
    profile += [_where_time_goes(results, f"width {w}{', dense (tp = 1)' if tp == 1 else ''}", shape_of[w],
                                 results.sweep_runs[(w, tp)], False, tp)
                for w in widths for tp in (1, 2) if (w, tp) in results.sweep_runs]
    if profile:
        out += ["", "Where a step's time goes (ms per step; CPU is the process's, gloo's threads included, so the "
                "parts can add up to more than the step; the slowest rank's; the "
                "collectives' time split into waiting for the other rank to arrive and the transfer after it did; the "
                "rest is time the rank was neither computing nor in a collective: another process had its core). "
                "The last two columns are the α–β model's collectives for the step:", "",
                markdown_table(["run", "step", "CPU", "waiting for the other rank", "collectives after both arrived",
                                "rest: off a core", "calls", "α–β fitted alone", "α–β, latency in the step"],
                               profile)]
    if widths:
        rate = _rate(results, shape_of[widths[-1]], results.sweep[(widths[-1], 1)])
        sweep_rows, measured = [], None
        for w in widths:
            t1, t2 = results.sweep[(w, 1)], results.sweep[(w, 2)]
            p1, p2 = (step_seconds(shape_of[w], c.batch_size, c.seq_len, tp, rate, bw, lat)["total"] for tp in (1, 2))
            q1, q2 = (step_seconds(shape_of[w], c.batch_size, c.seq_len, tp, rate, results.bandwidth,
                                   results.latency)["total"] for tp in (1, 2))
            one, two = results.sweep_runs.get((w, 1)), results.sweep_runs.get((w, 2))
            cpu = [_ms(one.cpu_seconds), _ms(two.cpu_seconds), f"{one.cpu_seconds / two.cpu_seconds:.2f}×"] \
                if one and two and two.cpu_seconds else ["–"] * 3
            measured = measured or (w if t2 < t1 else None)
            sweep_rows.append([w, f"{t1 * 1e3:,.1f}", f"{t2 * 1e3:,.1f}", f"{t1 / t2:.2f}×", *cpu, f"{q1 / q2:.2f}×",
                               f"{p1 / p2:.2f}×"])
        base = shape_of[widths[0]]
        predicted = crossover_width(base, c.batch_size, c.seq_len, rate, bw, lat)
        nvlink = crossover_width(base, c.batch_size, c.seq_len, H100_FLOPS, **NVLINK_H100)
        out += ["", f"Crossover ({c.sweep_layers}-layer GPT-2, heads of 64, vocabulary {c.sweep_vocab}): "
                f"compute rate {rate / 1e9:.2f} GFLOP/s from the widest tp = 1 run; CPU speed-up is tp = 1's CPU "
                f"time per step over one tp = 2 rank's (2× if the split divided all the work)", "",
                markdown_table(["width", "tp=1 ms", "tp=2 ms", "speed-up", "tp=1 CPU ms", "tp=2 CPU ms/rank",
                                "CPU speed-up",
                                "predicted speed-up (α–β fitted alone)",
                                "predicted speed-up (α–β, latency in the step)"],
                               sweep_rows), "",
                f"- measured: tp = 2 first beats tp = 1 at width {measured if measured else 'none of those measured'}",
                f"- predicted (α–β, this machine): from width {predicted if predicted else '> 8192'}",
                f"- predicted, NOT measured (H100 NVLink {NVLINK_H100['bandwidth'] / 1e9:.0f} GB/s, "
                f"{NVLINK_H100['latency'] * 1e6:.0f} µs per step, {H100_FLOPS / 1e12:.0f} TFLOP/s): from width "
                f"{nvlink if nvlink else '> 8192'}"]
    return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m parallel_lib.bench tp [--quick] [--max-tp N] [--models a,b]``; prints the tables."""
    parser = argparse.ArgumentParser(prog="python -m parallel_lib.bench tp", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model, two steps: a smoke run")
    parser.add_argument("--max-tp", type=int, help="largest tensor-parallel size (2 or 4; default 2)")
    parser.add_argument("--models", help="comma-separated GPT-2 sizes (default small,gpt2)")
    args = parser.parse_args(argv)
    config = QUICK if args.quick else Config()
    if args.max_tp is not None:
        config = replace(config, max_tp=args.max_tp)
    if args.models:
        config = replace(config, models=tuple(args.models.split(",")))
    print(markdown(measure(config)))
    return 0
