"""Sharding benchmark: ``python -m parallel_lib.bench sharding [--quick]``.

For GPT-2 tiny and small at 1, 2 and 4 ranks it trains a few steps with ZeRO stages 0-3
(mixed precision: bf16 parameters and gradients, fp32 master and AdamW moments), DDP,
PyTorch's ZeroRedundancyOptimizer and FSDP2 (both fp32), and prints per rank:

- the model-state bytes the storage census counted (parameters, gradients, optimizer
  states, after the backward of step 1) beside the ZeRO paper's formula, the worst rank's
  deviation and the padding that explains it;
- the bytes a rank sent in that step (collective counter) beside the traffic formula;
- tokens per second (slowest rank, warm-up step left out) beside DDP's.

Then the ZeRO paper's 7.5B / 64-GPU table from the same formula code, and Megatron-LM's
bytes-per-parameter conventions beside it. Memory is the point of this benchmark, so every
run is a handful of steps: the tokens/s are indicative, not a throughput study.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from parallel_lib.bench import parse_config
from parallel_lib.common.tables import markdown_table
from parallel_lib.runtime.environment import machine_label
from parallel_lib.runtime.launcher import launch
from parallel_lib.sharding.memory import megatron_bytes_per_param, zero_memory, zero_paper_table, zero_traffic
from parallel_lib.training import RunConfig, TrainResult, train_many, zero_plan

__all__ = ["Config", "QUICK", "VARIANTS", "Row", "measure", "markdown", "main"]

# name -> (the dp axis: Plan.sync and Plan.zero, RunConfig.precision, the ZeRO stage whose formula applies)
VARIANTS: dict[str, tuple[str, int, str, int]] = {
    **{f"ZeRO-{s}": ("zero", s, "bf16", s) for s in range(4)},
    "DDP": ("ddp", 0, "fp32", 0),
    "ZeroRedundancyOptimizer": ("zero_redundancy", 0, "fp32", 1),
    "FSDP2 fully_shard": ("fsdp2", 0, "fp32", 3),
}


@dataclass(frozen=True)
class Config:
    models: tuple[str, ...] = ("tiny", "small")
    world_sizes: tuple[int, ...] = (1, 2, 4)
    per_rank_batch: int = 4      # rows per rank: the same work per rank at every world size
    seq_len: int = 64
    vocab_size: int = 2048
    steps: int = 6               # step 1 is measured (after AdamW made its state); tokens/s leaves step 0 out


QUICK = Config(models=("tiny",), world_sizes=(1, 2), per_rank_batch=2, seq_len=16, vocab_size=256, steps=2)


@dataclass
class Row:
    model: str
    world_size: int
    variant: str
    precision: str
    num_params: int
    census: dict[str, float]     # mean over ranks (the formula is per rank on average)
    formula: dict[str, float]
    deviation: float             # |mean census total - formula total| / formula total
    worst: float                 # the same for the rank furthest from the formula
    padding: int                 # padded elements per rank's groups
    sent: float                  # bytes the busiest rank sent in the measured step
    traffic: float               # the formula's
    tokens_per_sec: float        # slowest rank


def _row(model: str, variant: str, results: Sequence[TrainResult]) -> Row:
    n, first = len(results), results[0]
    _, _, precision, stage = VARIANTS[variant]
    psi = first.trainable_parameters
    formula = zero_memory(psi, n, stage, precision)
    census = {k: sum(r.census[k] for r in results) / n for k in results[0].census}
    deviation = abs(census["total"] - formula["total"]) / formula["total"]
    worst = max(abs(r.census["total"] - formula["total"]) / formula["total"] for r in results)
    traffic = zero_traffic(psi, n, stage, precision)
    if variant == "ZeroRedundancyOptimizer":  # DDP's all-reduce, then each rank broadcasts its updated 1/N
        traffic = zero_traffic(psi, n, 0, precision) + 4 * psi / n
    return Row(model, n, variant, precision, psi, census, formula, deviation, worst, first.padding,
               max(r.wire_bytes for r in results), traffic,
               min(r.record.throughput(skip=1) for r in results))


def measure(config: Config) -> list[Row]:
    """One launch per (model, world size) running every variant in turn."""
    rows = []
    for model in config.models:
        for n in config.world_sizes:
            base = RunConfig(model=model, vocab_size=config.vocab_size, batch_size=config.per_rank_batch * n,
                             seq_len=config.seq_len, steps=config.steps, measure_step=1, return_state=False)
            jobs = [(zero_plan(n, stage, sync), replace(base, precision=precision))
                    for sync, stage, precision, _ in VARIANTS.values()]
            per_rank = launch(train_many, n, jobs, timeout=1800)
            rows += [_row(model, name, [r[k] for r in per_rank]) for k, name in enumerate(VARIANTS)]
    return rows


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f}"


def _verdict(rows: Sequence[Row]) -> list[str]:
    """Where each stage's saving pays for its traffic: memory saved vs tokens/s lost, against ZeRO-0."""
    lines = []
    for model in dict.fromkeys(r.model for r in rows):
        for n in sorted({r.world_size for r in rows if r.model == model and r.world_size > 1}):
            base = next(r for r in rows if (r.model, r.world_size, r.variant) == (model, n, "ZeRO-0"))
            parts = []
            for s in (1, 2, 3):
                r = next(r for r in rows if (r.model, r.world_size, r.variant) == (model, n, f"ZeRO-{s}"))
                saved = 1 - r.census["total"] / base.census["total"]
                speed = r.tokens_per_sec / base.tokens_per_sec
                parts.append(f"ZeRO-{s} saves {saved:.0%} of the model state at {speed:.2f}× ZeRO-0's tokens/s")
            lines.append(f"- GPT-2 {model}, {n} ranks: " + "; ".join(parts) + ".")
    return lines


def markdown(rows: Sequence[Row], machine: str = "") -> str:
    """The measured table, the verdict, and the paper's and Megatron's tables."""
    machine = machine or machine_label()
    ddp = {(r.model, r.world_size): r.tokens_per_sec for r in rows if r.variant == "DDP"}
    table = [[r.model, r.world_size, r.variant, r.precision,
              *(f"{_mb(r.census[k])} / {_mb(r.formula[k])}" for k in ("params", "grads", "optimizer")),
              f"{_mb(r.census['total'])} / {_mb(r.formula['total'])}", f"{r.deviation:.2%}", f"{r.worst:.2%}",
              r.padding,
              f"{_mb(r.sent)} / {_mb(r.traffic)}", f"{r.tokens_per_sec:,.0f}",
              f"{r.tokens_per_sec / ddp[r.model, r.world_size]:.2f}×" if (r.model, r.world_size) in ddp else "-"]
             for r in rows]
    worst = max(r.deviation for r in rows)
    uneven = max(rows, key=lambda r: r.worst)
    lines = [f"### Sharded data parallelism — model-state bytes per rank and traffic, {machine}", "",
             markdown_table(["model", "N", "variant", "precision", "params MB (census / formula)", "grads MB",
                             "optimizer MB", "total MB", "mean off by", "worst rank off by", "padding (elements)",
                             "sent per step MB (counted / formula)", "tokens/s", "vs DDP"], table,
                            "lrllrrrrrrrrrr"), "",
             f"Census (mean over ranks) vs formula, largest deviation: {worst:.2%} "
             f"({'within' if worst <= 0.05 else 'NOT within'} 5%). Padding rounds each flat group up to a multiple "
             f"of N. The furthest single rank: {uneven.worst:.2%} ({uneven.variant}, {uneven.model}, "
             f"N = {uneven.world_size}): ZeroRedundancyOptimizer gives whole tensors to ranks, so the rank holding "
             "the embedding holds more; the course's flat shards are even to within N-1 elements per group. "
             "DDP's and ZeroRedundancyOptimizer's all-reduce goes through a counted comm hook; "
             "ZeroRedundancyOptimizer's traffic formula is the all-reduce's 2(N-1)/N·4Ψ plus the 4Ψ/N each rank "
             "broadcasts (charged to its source); FSDP2 keeps its root group gathered from forward to backward, "
             "so it sends a little less than 3 passes.", "",
             *_verdict(rows), "",
             "ZeRO paper (Rajbhandari et al. 2020, figure 1): 7.5B parameters, 64 GPUs, mixed-precision Adam (K = 12), "
             "from the same `zero_memory`:", "",
             markdown_table(["stage", "GB per GPU (formula)", "paper"],
                            [[s, f"{gb:.1f}", p]
                             for (s, gb), p in zip(zero_paper_table(), ("120", "31.4", "16.6", "1.9"))],
                            "lrr"), "",
             "Megatron-LM distributed optimizer (docs/source/distrib_optimizer.md), bytes per parameter, d = 64:", "",
             markdown_table(["parameters, gradients", "plain", "distributed", "why"],
                            [[a, b, f"{c:.2f}", w] for a, b, c, w in megatron_bytes_per_param(64)], "lrrl")]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    config, _ = parse_config(argv, "sharding", __doc__, QUICK, Config, "tiny model, 1 and 2 ranks, 2 steps: a smoke run")
    print(markdown(measure(config)))
    return 0
