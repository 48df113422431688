"""Data-parallel benchmark: ``python -m parallel_lib.bench dp [--quick]``.

Trains GPT-2 (tiny on every device; ``--model gpt2`` for the 124M shape) with the one training
entry, ``Plan(dp=world_size, sync=...)``, a fixed batch per rank, and compares:

- **1 rank**: one rank alone (a launch of its own, sync ``none``): the baseline;
- **ceiling**: every rank of one launch trains with sync ``none``: the same compute with no
  communication, the most this machine can give (cores, memory bandwidth);
- each gradient-sync method: ``naive`` (one all-reduce per parameter), ``bucketed``
  (25 MB buckets launched from gradient hooks during backward), ``ring`` (buckets
  through the hand-written ring) and PyTorch's ``ddp``.

Every step processes the same shape (rows padded to ``max_length``), so tokens/s
here counts processed positions, ``world_size x per_rank_batch x max_length`` per
step over the slowest rank's step time. Variants alternate repeat by repeat, warm-up
steps are dropped, and medians are kept (over steps, then repeats), so that load from
other programs spreads over all variants alike. Each rank uses one intra-op thread; the
variants of ``world_size`` ranks share one launch per repeat.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from parallel_lib.bench import REPEATS, parse_config
from parallel_lib.common.tables import markdown_table
from parallel_lib.common.training import busy_machine_warning
from parallel_lib.runtime.device import rank_device
from parallel_lib.runtime.environment import machine_label
from parallel_lib.runtime.launcher import launch
from parallel_lib.training import AVERAGERS, Plan, RunConfig, TrainResult, job_step_times, train_many

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


def _run(config: Config, world_size: int) -> RunConfig:
    return RunConfig(data="corpus", model=config.model, batch_size=config.per_rank_batch * world_size,
                     steps=config.steps, train_examples=config.train_examples, vocab_size=config.vocab_size,
                     seq_len=config.max_length, return_state=False)


def _worker(rank: int, world_size: int, jobs: list[tuple[Plan, RunConfig]]) -> tuple[list[TrainResult], str]:
    """Every job in turn on this rank, and the rank's device."""
    return train_many(rank, world_size, jobs), str(rank_device())


def _median_step(results: list[TrainResult], warmup: int) -> float:
    """The median over steps after warm-up of the slowest rank's step."""
    return statistics.median(job_step_times(results)[warmup:])


def measure(config: Config = Config(), timeout: float = 1800.0) -> Results:
    """Time every variant ``config.repeats`` times: a 1-rank launch and one launch of ``world_size`` ranks
    (one thread each) per repeat.

    Raises:
        ValueError: a method that is not one of chapter 01's averagers, fewer than 2 ranks or no step to time.
    """
    methods = [m for m in AVERAGERS if m != CEILING]
    unknown = [m for m in config.methods if m not in methods]
    if unknown or config.world_size < 2 or config.steps <= config.warmup:
        raise ValueError(f"need methods from {methods}, world_size >= 2 and steps > warmup, got "
                         f"methods={config.methods}, world_size={config.world_size}, steps={config.steps}, "
                         f"warmup={config.warmup}")
    n = config.world_size
    variants = (CEILING,) + config.methods
    jobs = [(Plan(dp=n, sync=sync, micro_batches=1), _run(config, n)) for sync in variants]
    seconds: dict[str, list[float]] = {}
    for _ in range(config.repeats):
        solo, device = launch(_worker, 1, [(Plan(sync="none", micro_batches=1), _run(config, 1))], timeout=timeout,
                              threads_per_rank=1)[0]
        seconds.setdefault(SOLO, []).append(_median_step(solo, config.warmup))
        per_rank = launch(_worker, n, jobs, timeout=timeout, threads_per_rank=1)
        for k, sync in enumerate(variants):
            seconds.setdefault(sync, []).append(_median_step([results[k] for results, _ in per_rank], config.warmup))
        device = per_rank[0][1]
    return Results(config, machine_label(), config.model, device,
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
    config, _ = parse_config(argv, "dp", __doc__, QUICK, Config, "tiny batches, a few steps, 1 repeat: a smoke run",
                             [("--world-size", {"type": int, "help": "ranks (default 2)"}), REPEATS,
                              ("--model", {"help": "GPT-2 size (default tiny on every device; gpt2 is the real 124M "
                                                   "shape)"})])
    print(markdown(measure(config)))
    return 0
