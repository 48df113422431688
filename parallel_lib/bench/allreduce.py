"""All-reduce benchmark: ``python -m parallel_lib.bench allreduce [--quick]``.

Times ``ring_all_reduce`` (hand-written, point-to-point messages) against the
backend's own ``dist.all_reduce`` for message sizes from 1 KB to 64 MB, in one launch
of ``world_size`` ranks (gloo on CPU, NCCL on GPUs), and reports for each what
nccl-tests reports: time, algorithm bandwidth (size / time) and bus bandwidth
(algbw · 2(N-1)/N, comparable with a link's bandwidth whatever N is). The ring's
cost model ``2(N-1)/N · S/B + 2(N-1)·α`` is fitted to the ring's times and printed
beside them.

Variants alternate repeat by repeat after a warm-up, each timing is the slowest
rank's (a collective ends when its last rank does), and the median is kept, so load
from other programs spreads over both variants alike. Each ring result is checked
against ``dist.all_reduce`` (``Results.max_error``, printed under the table).
"""

from __future__ import annotations

import math

import statistics
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from parallel_lib.bench import REPEATS, parse_config
from parallel_lib.common.compare import max_abs_difference
from parallel_lib.common.tables import markdown_table
from parallel_lib.common.timeline import DeviceClock
from parallel_lib.data_parallel.ring import (
    algorithm_bandwidth,
    allreduce_cost,
    bus_bandwidth,
    fit_allreduce_cost,
    ring_all_reduce,
)
from parallel_lib.runtime.device import rank_device
from parallel_lib.runtime.environment import machine_label
from parallel_lib.runtime.launcher import launch

__all__ = ["Config", "QUICK", "Results", "measure", "markdown", "main"]

VARIANTS = {"builtin": "dist.all_reduce", "ring": "ring_all_reduce"}


@dataclass(frozen=True)
class Config:
    """Message sizes in bytes (float32 elements), ranks and repeats."""

    world_size: int = 2
    sizes: tuple[int, ...] = tuple(4**k * 2**10 for k in range(9))  # 1 KB, 4 KB, ..., 64 MB
    repeats: int = 9
    warmup: int = 2
    backend: str = "auto"


QUICK = Config(sizes=(2**10, 2**15, 2**20), repeats=3, warmup=1)


@dataclass
class Results:
    """Median seconds per size: ``seconds[variant][nbytes]``; the cost model fitted to the ring."""

    config: Config
    machine: str
    backend: str
    seconds: dict[str, dict[int, float]] = field(default_factory=dict)
    bandwidth: float = float("nan")  # fitted B, bytes/s
    latency: float = float("nan")    # fitted alpha, s
    fit_error: str = ""              # why the model could not be fitted, if it could not
    max_error: float = float("nan")  # largest |ring - dist.all_reduce| of any element, size or rank

    def algbw(self, variant: str, nbytes: int) -> float:
        return algorithm_bandwidth(nbytes, self.seconds[variant][nbytes])

    def busbw(self, variant: str, nbytes: int) -> float:
        return bus_bandwidth(self.algbw(variant, nbytes), self.config.world_size)

    def model_seconds(self, nbytes: int) -> float:
        """The fitted model's seconds for ``nbytes``; NaN (printed as such) when nothing was fitted."""
        if self.fit_error or not (math.isfinite(self.bandwidth) and math.isfinite(self.latency)):
            return float("nan")
        return allreduce_cost(nbytes, self.config.world_size, self.bandwidth, self.latency)

    def ratio(self, nbytes: int) -> float:
        """Ring speed over the built-in's (> 1: the ring is faster)."""
        return self.seconds["builtin"][nbytes] / self.seconds["ring"][nbytes]


def _worker(rank: int, world_size: int, config: Config) -> tuple[dict[str, dict[int, list[float]]], float]:
    """This rank's seconds per repeat ``times[variant][nbytes]``, and its largest |ring - built-in|."""
    device = rank_device()
    clock = DeviceClock([device])  # this rank's GPU only: a collective on it ends when its kernels have run
    ops = {"builtin": dist.all_reduce, "ring": ring_all_reduce}
    times: dict[str, dict[int, list[float]]] = {v: {} for v in VARIANTS}
    max_error = 0.0
    for nbytes in config.sizes:
        x = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(rank)).to(device)
        expected, got = x.clone(), x.clone()
        dist.all_reduce(expected)
        ring_all_reduce(got)
        max_error = max(max_error, max_abs_difference(got, expected))  # inf if the ring produced a NaN
        for repeat in range(config.warmup + config.repeats):
            for name, op in ops.items():
                dist.barrier()
                start = clock()
                op(x)
                end = clock()
                if repeat >= config.warmup:
                    times[name].setdefault(nbytes, []).append(end - start)
    return times, max_error


def measure(config: Config = Config(), timeout: float = 600.0) -> Results:
    """Launch ``config.world_size`` ranks (one thread each), time both variants, fit the model."""
    if config.world_size < 2:
        raise ValueError(f"world_size must be >= 2 (one rank has nothing to reduce), got {config.world_size}")
    outputs = launch(_worker, config.world_size, config, backend=config.backend, timeout=timeout, threads_per_rank=1)
    results = Results(config, machine_label(), "nccl" if torch.cuda.device_count() >= config.world_size
                      and config.backend != "gloo" else "gloo")
    per_rank = [times for times, _ in outputs]
    results.max_error = max(error for _, error in outputs)
    for variant in VARIANTS:
        results.seconds[variant] = {
            nbytes: statistics.median(max(ts) for ts in zip(*(r[variant][nbytes] for r in per_rank)))
            for nbytes in config.sizes}
    sizes = list(config.sizes)
    try:
        results.bandwidth, results.latency = fit_allreduce_cost(
            sizes, [results.seconds["ring"][s] for s in sizes], config.world_size)
    except ValueError as e:  # too few or too small sizes (--quick) on a noisy machine: no model
        results.fit_error = str(e)
    return results


def _size(nbytes: int) -> str:
    for unit, scale in (("MB", 2**20), ("KB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def markdown(results: Results) -> str:
    """The pasteable table, headed by the machine and the fitted cost model."""
    c = results.config
    rows = []
    for s in c.sizes:
        cells = [_size(s)]
        for v in VARIANTS:
            cells += [f"{results.seconds[v][s] * 1e3:.3f}", f"{results.algbw(v, s) / 1e9:.2f}",
                      f"{results.busbw(v, s) / 1e9:.2f}"]
        rows.append(cells + [f"{results.ratio(s):.2f}×", f"{results.model_seconds(s) * 1e3:.3f}"])
    header = ["size", "all_reduce ms", "algbw", "busbw", "ring ms", "algbw", "busbw", "ring speed vs all_reduce",
              "model ms"]
    lines = [f"All-reduce, {c.world_size} {results.backend} ranks on {results.machine}, float32, "
             f"median of {c.repeats} (slowest rank per repeat). Bandwidths in GB/s.", "",
             markdown_table(header, rows, align="r" * len(header))]
    lines += ["", f"Largest |ring_all_reduce - dist.all_reduce| over all sizes and ranks: {results.max_error:.2g}."]
    model = "Ring cost model 2(N-1)/N·S/B + 2(N-1)·α fitted to the ring: "
    lines += [model + (f"not fitted ({results.fit_error})." if results.fit_error else
                           f"B = {results.bandwidth / 1e9:.2f} GB/s, α = {results.latency * 1e6:.1f} µs.")]
    large = [s for s in c.sizes if s >= 4 * 2**20]
    if large:
        worst = min(results.ratio(s) for s in large)
        lines.append(f"Ring speed / built-in at >= 4 MB: worst {worst:.2f}× (target >= 0.7×).")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    config, _ = parse_config(argv, "allreduce", __doc__, QUICK, Config, "three sizes up to 1 MB, 3 repeats: a smoke run",
                             [("--world-size", {"type": int, "help": "ranks (default 2)"}), REPEATS])
    print(markdown(measure(config)))
    return 0
