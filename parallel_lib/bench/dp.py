"""Data-parallel benchmark: ``python -m parallel_lib.bench dp [--quick]``.

Trains GPT-2 (tiny on every device; ``--model gpt2`` for the 124M shape) with a fixed batch per rank and
compares, in one launch of ``world_size`` ranks:

- **1 rank**: rank 0 trains alone while the others wait at a barrier: the baseline;
- **ceiling**: every rank trains with sync ``none``: the same compute with no
  communication, the most this machine can give (cores, memory bandwidth);
- each gradient-sync method: ``naive`` (one all-reduce per parameter), ``bucketed``
  (25 MB buckets launched from gradient hooks during backward), ``ring`` (buckets
  through the hand-written ring) and PyTorch's ``ddp``.

Every step processes the same shape (rows padded to ``max_length``), so tokens/s
here counts processed positions, ``world_size x per_rank_batch x max_length`` per
step over the slowest rank's step time. Variants alternate repeat by repeat, warm-up
steps are dropped, and medians are kept (over steps, then repeats), so that load from
other programs spreads over all variants alike. Each rank uses one intra-op thread.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, field, replace

import torch.distributed as dist

from parallel_lib.bench import repeats
from parallel_lib.common.tables import markdown_table
from parallel_lib.common.training import busy_machine_warning
from parallel_lib.data_parallel.dp import SYNC_METHODS, DPConfig, run_dp, train_replica
from parallel_lib.runtime.environment import machine_label
from parallel_lib.runtime.launcher import launch

__all__ = ["Config", "QUICK", "Results", "measure", "markdown", "main"]

SOLO, CEILING = "1 rank", "none"


@dataclass(frozen=True)
class Config:
    """The work per rank and how often it is timed."""

    world_size: int = 2
    model: str = "tiny"            # a GPT-2 size, on every device ("gpt2": the real 124M shape)
    per_rank_batch: int = 32       # rows per rank and step: fixed, so every variant does equal work per rank;
    #                                32 x 64 positions keeps compute well above the per-step sync on a CPU
    max_length: int = 64           # positions per row (all rows padded to it)
    steps: int = 25                # per variant and repeat
    warmup: int = 5                # first steps left out (allocator, caches, first buckets)
    repeats: int = 3
    train_examples: int = 2048
    vocab_size: int = 2048
    methods: tuple[str, ...] = ("naive", "bucketed", "ring", "ddp")


QUICK = Config(per_rank_batch=2, max_length=16, steps=3, warmup=1, repeats=1, train_examples=64, vocab_size=300)


@dataclass
class Results:
    """Median seconds per step of each variant (``SOLO``, ``CEILING`` and the methods)."""

    config: Config
    machine: str
    model: str
    device: str
    step_seconds: dict[str, float] = field(default_factory=dict)

    def ranks(self, variant: str) -> int:
        return 1 if variant == SOLO else self.config.world_size

    def tokens_per_sec(self, variant: str) -> float:
        c = self.config
        return self.ranks(variant) * c.per_rank_batch * c.max_length / self.step_seconds[variant]

    def speedup(self, variant: str) -> float:
        """Tokens/s over one rank's."""
        return self.tokens_per_sec(variant) / self.tokens_per_sec(SOLO)

    def of_ceiling(self, variant: str) -> float:
        return self.tokens_per_sec(variant) / self.tokens_per_sec(CEILING)


def _dp_config(config: Config, world_size: int, sync: str) -> DPConfig:
    return DPConfig(sync=sync, model=config.model, batch_size=config.per_rank_batch * world_size,
                    max_steps=config.steps, train_examples=config.train_examples, val_examples=8,
                    vocab_size=config.vocab_size, max_length=config.max_length, pad_to_max_length=True)


def _worker(rank: int, world_size: int, config: Config) -> tuple[dict[str, list[float]], str, str]:
    """Rank 0's per-repeat median step seconds of every variant, the model and device names."""
    def median_step(step_times: list[float]) -> float:
        return statistics.median(step_times[config.warmup:])

    seconds: dict[str, list[float]] = {}
    for _ in range(config.repeats):
        if rank == 0:  # the baseline: one rank alone, no messages; the others wait
            solo = train_replica(0, 1, _dp_config(config, 1, "none"))
            seconds.setdefault(SOLO, []).append(median_step(solo.local.step_times))
        dist.barrier()
        for sync in (CEILING,) + config.methods:
            result = run_dp(rank, world_size, _dp_config(config, world_size, sync))
            seconds.setdefault(sync, []).append(median_step(result.record.step_times))  # slowest rank's
    return seconds, result.model, result.device


def measure(config: Config = Config(), timeout: float = 1800.0) -> Results:
    """Launch ``config.world_size`` ranks with one thread each and time every variant."""
    unknown = [m for m in config.methods if m not in SYNC_METHODS or m == CEILING]
    if unknown or config.world_size < 2 or config.steps <= config.warmup:
        raise ValueError(f"need methods from {SYNC_METHODS[1:]}, world_size >= 2 and steps > warmup, got "
                         f"methods={config.methods}, world_size={config.world_size}, steps={config.steps}, "
                         f"warmup={config.warmup}")
    seconds, model, device = launch(_worker, config.world_size, config, timeout=timeout, threads_per_rank=1)[0]
    return Results(config, machine_label(), model, device,
                   {variant: statistics.median(values) for variant, values in seconds.items()})


def markdown(results: Results, targets: bool = True) -> str:
    """The pasteable table, headed by the machine, with the targets of the course.

    ``targets=False`` leaves out the targets line, which is set for the full benchmark: a short run
    (a notebook's) is not held to it. A warning is added when even the ceiling did not scale.
    """
    c, n = results.config, results.config.world_size
    names = {SOLO: "1 rank (baseline)", CEILING: f"{n} ranks, no sync (ceiling)"}
    rows = [[names.get(variant, variant), results.ranks(variant), f"{results.step_seconds[variant] * 1e3:.1f}",
             f"{results.tokens_per_sec(variant):,.0f}", f"{results.speedup(variant):.2f}×",
             f"{results.speedup(variant) / results.ranks(variant):.0%}", f"{results.of_ceiling(variant):.2f}×"]
            for variant in (SOLO, CEILING) + c.methods]
    lines = [f"Data-parallel GPT-2 ({results.model}) on {results.machine}, {results.device} ranks, "
             f"{c.per_rank_batch} rows x {c.max_length} positions per rank and step, median of {c.repeats} "
             f"repeats x {c.steps - c.warmup} steps.", "",
             markdown_table(["variant", "ranks", "ms / step", "tokens/s", "× 1 rank", "scaling efficiency",
                             "× ceiling"], rows, align="lrrrrrr")]
    warning = busy_machine_warning(results.speedup(CEILING), n)
    if warning:
        lines += ["", warning]
    if targets and "bucketed" in c.methods:
        line = (f"bucketed: {results.speedup('bucketed'):.2f}× one rank (target >= 1.7× at 2 ranks), "
                f"{results.of_ceiling('bucketed'):.2f}× the ceiling (target >= 0.9×)")
        if "ddp" in c.methods:
            ratio = results.tokens_per_sec("bucketed") / results.tokens_per_sec("ddp")
            line += f", {ratio:.2f}× DDP (target within 5%)"
        lines += ["", line + "."]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallel_lib.bench dp", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny batches, a few steps, 1 repeat: a smoke run")
    parser.add_argument("--world-size", type=int, help="ranks (default 2)")
    parser.add_argument("--repeats", type=repeats, help="repeats per variant (median is reported)")
    parser.add_argument("--model", help="GPT-2 size (default tiny on every device; gpt2 is the real 124M shape)")
    args = parser.parse_args(argv)
    config = QUICK if args.quick else Config()
    for name in ("world_size", "repeats", "model"):
        if getattr(args, name) is not None:
            config = replace(config, **{name: getattr(args, name)})
    print(markdown(measure(config)))
    return 0
