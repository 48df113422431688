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

The α–β constants are fitted to this machine's gloo all-reduce in the same run; the
compute rate is the tp = 1 run's FLOPs (``training_flops``) over its step time.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from parallel_lib.bench._tp_runs import IMPLEMENTATIONS, Run, measure_all
from parallel_lib.common.models import gpt2_config
from parallel_lib.common.tables import markdown_table
from parallel_lib.runtime.environment import machine_label
from parallel_lib.runtime.launcher import launch
from parallel_lib.cost.shape import GPTShape
from parallel_lib.tensor_parallel.cost import NVLINK_H100, crossover_width, step_seconds, training_flops

__all__ = ["Config", "QUICK", "SWEEP", "Results", "measure", "sweep_series", "markdown", "main"]

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
    """Measured runs keyed by (model, tp, implementation), the sweep, and the fitted constants."""

    config: Config
    machine: str
    bandwidth: float
    latency: float
    runs: dict[tuple[str, int, str], Run] = field(default_factory=dict)
    sweep: dict[tuple[int, int], float] = field(default_factory=dict)  # (width, tp) -> seconds


def _shape(name: str, vocab: int, **overrides: Any) -> GPTShape:
    return GPTShape.of(gpt2_config(name, vocab, **overrides))


def _sweep_overrides(width: int, c: Config) -> dict[str, Any]:
    return dict(n_embd=width, n_head=max(2, width // 64), n_layer=c.sweep_layers)


def measure(config: Config = Config()) -> Results:
    """Run every variant, one launch per tensor-parallel size, and fit the all-reduce; see the module docstring.

    Every rank uses one intra-op thread, so tp ranks use tp cores: on a CPU, "devices" are cores.

    Raises:
        ValueError: ``max_tp`` below 2, or ``steps <= warmup``.
    """
    if config.max_tp < 2 or config.steps <= config.warmup or config.sweep_steps <= config.sweep_warmup:
        raise ValueError(f"need max_tp >= 2 and steps > warmup, got max_tp={config.max_tp}, steps={config.steps}, "
                         f"warmup={config.warmup}, sweep_steps={config.sweep_steps}, sweep_warmup={config.sweep_warmup}")
    c, fitted = config, (0.0, 0.0)
    runs: dict[tuple[str, int, str], Run] = {}
    sweep: dict[tuple[int, int], float] = {}
    for tp in [t for t in (1, 2, 4) if t <= c.max_tp]:
        keys = [(name, tp, impl) for name in c.models for impl in (IMPLEMENTATIONS if tp > 1 else ("course",))]
        jobs = [(impl, name, c.vocab_size, {}, c.steps, c.warmup) for name, _, impl in keys]
        widths = list(c.sweep_widths) if tp <= 2 else []
        jobs += [("course", "tiny", c.sweep_vocab, _sweep_overrides(w, c), c.sweep_steps, c.sweep_warmup) for w in widths]
        measured, fit = launch(measure_all, tp, jobs, c.batch_size, c.seq_len, tp == 2,
                               backend="gloo", timeout=c.timeout, threads_per_rank=1)[0]
        fitted = fit or fitted
        runs.update(zip(keys, measured))
        sweep.update({(w, tp): run.step_seconds for w, run in zip(widths, measured[len(keys):])})
    return Results(c, machine_label(), fitted[0], fitted[1], runs, sweep)


def _rate(results: Results, shape: GPTShape, seconds: float) -> float:
    c = results.config
    return training_flops(shape, c.batch_size, c.seq_len) / seconds


def sweep_series(results: Results) -> tuple[list[int], dict[int, list[float]], dict[int, list[float]]]:
    """``(widths, {tp: measured seconds}, {tp: α–β predicted seconds})`` of the width sweep, for plotting."""
    c = results.config
    widths = sorted({w for w, _ in results.sweep})
    shapes = [_shape("tiny", c.sweep_vocab, **_sweep_overrides(w, c)) for w in widths]
    rate = _rate(results, shapes[-1], results.sweep[(widths[-1], 1)])
    measured = {tp: [results.sweep[(w, tp)] for w in widths] for tp in (1, 2)}
    predicted = {tp: [step_seconds(s, c.batch_size, c.seq_len, tp, rate, results.bandwidth, results.latency)["total"]
                      for s in shapes] for tp in (1, 2)}
    return widths, measured, predicted


def markdown(results: Results) -> str:
    """The three tables, labelled with the machine and the fitted constants."""
    c, bw, lat = results.config, results.bandwidth, results.latency
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
    out = [f"Tensor parallelism on {results.machine}: batch {c.batch_size} x {c.seq_len} tokens, AdamW, fp32, "
           f"median of {c.steps - c.warmup} steps ({c.sweep_steps - c.sweep_warmup} in the sweep); gloo all-reduce fitted to bandwidth {bw / 1e9:.2f} GB/s, "
           f"latency {lat * 1e6:.0f} µs per ring step", "",
           markdown_table(["model", "tp", "implementation", "step ms", "tokens/s", "predicted ms (α–β)",
                           "params MB/rank", "activations MB/rank", "sent MB/step/rank"], rows)]
    widths = sorted({w for w, _ in results.sweep})
    if widths:
        shape_of = {w: _shape("tiny", c.sweep_vocab, **_sweep_overrides(w, c)) for w in widths}
        rate = _rate(results, shape_of[widths[-1]], results.sweep[(widths[-1], 1)])
        sweep_rows, measured = [], None
        for w in widths:
            t1, t2 = results.sweep[(w, 1)], results.sweep[(w, 2)]
            p1, p2 = (step_seconds(shape_of[w], c.batch_size, c.seq_len, tp, rate, bw, lat)["total"] for tp in (1, 2))
            measured = measured or (w if t2 < t1 else None)
            sweep_rows.append([w, f"{t1 * 1e3:,.1f}", f"{t2 * 1e3:,.1f}", f"{t1 / t2:.2f}×", f"{p1 * 1e3:,.1f}",
                               f"{p2 * 1e3:,.1f}", f"{p1 / p2:.2f}×"])
        base = shape_of[widths[0]]
        predicted = crossover_width(base, c.batch_size, c.seq_len, rate, bw, lat)
        nvlink = crossover_width(base, c.batch_size, c.seq_len, H100_FLOPS, **NVLINK_H100)
        out += ["", f"Crossover ({c.sweep_layers}-layer GPT-2, heads of 64, vocabulary {c.sweep_vocab}): "
                f"compute rate {rate / 1e9:.2f} GFLOP/s from the widest tp = 1 run", "",
                markdown_table(["width", "tp=1 ms", "tp=2 ms", "speed-up", "predicted tp=1 ms", "predicted tp=2 ms",
                                "predicted speed-up"], sweep_rows), "",
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
