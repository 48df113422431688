"""Context-parallel benchmark: ``python -m parallel_lib.bench context [--quick] [--cps 2,4] [--seq-lens ...]``.

One run prints three tables (every number measured on this machine, labelled with it):

1. **memory per rank and step time against sequence length**, for full attention and tiled
   attention in one process and ring attention (contiguous and zig-zag) and Ulysses on cp gloo
   ranks: what autograd keeps for backward beyond q, k, v (the tensor census) beside
   :func:`~parallel_lib.context_parallel.cost.attention_saved_bytes`, forward + backward
   time, and the bytes each rank sent (the collective counter) beside
   :func:`~parallel_lib.context_parallel.cost.cp_wire_bytes`;
2. **causal work per rank**, ring attention at the longest length: the score entries each rank
   computed forward, contiguous against zig-zag (the contiguous split's last rank does about
   2·cp − 1 times its first rank's work);
3. **when a ring step hides its transfer**: one step's compute and its key/value exchange timed
   apart at each length (cp = 2); the compute rate (``ring_step_flops`` over the longest
   step's compute time) and the link's α and β (fitted to the exchanges) give
   :func:`~parallel_lib.context_parallel.cost.hiding_seq_len`'s prediction, set beside the first
   length that measured hidden; and the same formula at a GPU's rate and link (a prediction only).

On a shared CPU the "transfer" is a memory copy through gloo and both ranks compete for the same
cores: the memory and the work are exact, the times are this machine's.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field, replace
from typing import Optional

from parallel_lib.common.tables import markdown_table
from parallel_lib.context_parallel.cost import attention_saved_bytes, cp_wire_bytes, hiding_seq_len, ring_step_flops
from parallel_lib.context_parallel.measure import (RingStepMeasured, Shape, measure_on_ranks, measure_one_process,
                                                   measure_ring_steps, measured_hiding_seq_len, rank_rows)
from parallel_lib.context_parallel.verify import several
from parallel_lib.cost.alpha_beta import fit_alpha_beta
from parallel_lib.runtime.environment import machine_label
from parallel_lib.runtime.launcher import launch
from parallel_lib.tensor_parallel.cost import NVLINK_H100

__all__ = ["Config", "QUICK", "Results", "measure", "census_deviation", "markdown", "main"]

H100_FLOPS = 400e12   # bf16, about 40% of the datasheet's dense peak: a typical achieved rate (assumption)
GPU_SHAPE = dict(batch=1, heads=16, head_dim=128, cp=16)   # Llama 3 405B's 128 heads over TP 8, at CP 16


@dataclass(frozen=True)
class Config:
    """What is measured: lengths, cp sizes, the attention's shape, and the lengths of the ring-step timing."""

    seq_lens: tuple[int, ...] = (128, 256, 512, 1024)
    cps: tuple[int, ...] = (2, 4)
    shape: Shape = Shape(batch=1, heads=4, head_dim=16, block=32, repeats=3)
    step_lens: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048)
    step_repeats: int = 7
    timeout: float = 1200.0


QUICK = Config(seq_lens=(32, 64), cps=(2,), shape=Shape(batch=1, heads=4, head_dim=8, block=8, repeats=1),
               step_lens=(16, 32, 64), step_repeats=2, timeout=300.0)


@dataclass
class Results:
    """The rows of :func:`~parallel_lib.context_parallel.measure.measure_context` and the ring-step timings."""

    config: Config
    machine: str
    rows: list[dict] = field(default_factory=list)
    steps: list[RingStepMeasured] = field(default_factory=list)


def measure(config: Config = Config()) -> Results:
    """Full and tiled attention here, then one launch per cp (the ring-step timing rides in the first).

    Raises:
        ValueError: a length not divisible by 2·cp for some cp; a cp below 2.
    """
    c = config
    for cp in c.cps:
        if cp < 2:
            raise ValueError(f"every cp must be >= 2 (one rank is the one-process rows), got cps={c.cps}")
        for s in c.seq_lens + (c.step_lens if cp == c.cps[0] else ()):
            if s % (2 * cp):
                raise ValueError(f"every length must be divisible by 2·cp = {2 * cp}, got {s}")
    results = Results(c, machine_label(), [asdict(m) for m in measure_one_process(c.seq_lens, c.shape)])
    for i, cp in enumerate(c.cps):
        jobs = [(measure_on_ranks, (list(c.seq_lens), c.shape, c.timeout))]
        if i == 0:
            jobs.append((measure_ring_steps, (list(c.step_lens), replace(c.shape, repeats=c.step_repeats),
                                              c.timeout)))
        per_rank = launch(several, cp, jobs, backend="gloo", timeout=c.timeout, threads_per_rank=1)
        results.rows += rank_rows([r[0] for r in per_rank], cp)
        if i == 0:
            results.steps = per_rank[0][1]
    return results


def _formula(row: dict, shape: Shape) -> tuple[int, float]:
    """(bytes kept for backward, bytes sent) per rank by the formulas, for one row."""
    method, cp, s = row["method"], row["cp"], row["seq_len"]
    saved = attention_saved_bytes(method, shape.batch, shape.heads, s, shape.head_dim, causal=True, cp=cp)
    sent = cp_wire_bytes(method, shape.batch, shape.heads, s, shape.head_dim, cp).total if cp > 1 else 0.0
    return saved, sent


def census_deviation(results: Results) -> float:
    """The largest ``|census / formula − 1|`` over every rank of every row: the memory formula's error."""
    shape = results.config.shape
    return max(abs(saved / _formula(row, shape)[0] - 1) for row in results.rows for saved in row["saved_bytes"])


def _hiding(results: Results) -> list[str]:
    """The third table's rows and the lines under it."""
    c, steps = results.config, sorted(results.steps, key=lambda m: m.seq_len)
    b, n, d, cp = c.shape.batch, c.shape.heads, c.shape.head_dim, c.cps[0]
    rows = [[m.seq_len, m.seq_len // cp, f"{m.compute_s * 1e3:,.3f}", f"{m.transfer_s * 1e3:,.3f}",
             f"{m.block_bytes / 1024:,.0f}", "yes" if m.compute_s >= m.transfer_s else "no"] for m in steps]
    longest = steps[-1]
    rate = ring_step_flops(b, n, longest.seq_len, d, cp) / longest.compute_s
    link = fit_alpha_beta("send", 2, [m.block_bytes for m in steps], [m.transfer_s for m in steps])
    predicted = hiding_seq_len(b, n, d, cp, rate, link.alpha, link.bandwidth)
    measured = measured_hiding_seq_len(steps)
    seen = f"{measured:,}" if measured else f"none of those measured (up to {steps[-1].seq_len:,})"
    gpu = hiding_seq_len(flops_per_s=H100_FLOPS, latency_s=NVLINK_H100["latency"],
                         bytes_per_s=NVLINK_H100["bandwidth"], itemsize=2, **GPU_SHAPE)
    return [f"### When a ring step hides its transfer (cp = {cp}, {b} x {n} heads x {d}, fp32, tiles of "
            f"{c.shape.block}; median of {c.step_repeats}, slowest rank)", "",
            markdown_table(["sequence", "tokens per rank", "compute ms", "transfer ms", "K+V block KiB", "hidden"],
                           rows, "rrrrrl"), "",
            f"- compute rate {rate / 1e9:.2f} GFLOP/s (ring_step_flops over the {longest.seq_len}-token step); "
            f"link fitted to the exchanges: α = {link.alpha * 1e6:.0f} µs, β = {link.bandwidth / 1e9:.3g} GB/s",
            f"- predicted (α–β, this machine): hidden from sequence {predicted:,}",
            f"- measured: hidden from sequence {seen}",
            f"- predicted, NOT measured (H100 NVLink {NVLINK_H100['bandwidth'] / 1e9:.0f} GB/s, "
            f"{NVLINK_H100['latency'] * 1e6:.0f} µs, {H100_FLOPS / 1e12:.0f} TFLOP/s bf16; {GPU_SHAPE['heads']} heads "
            f"x {GPU_SHAPE['head_dim']} per rank, cp {GPU_SHAPE['cp']}): hidden from sequence {gpu:,}"]


def markdown(results: Results) -> str:
    """The three tables, each labelled with the machine."""
    c, shape = results.config, results.config.shape
    deviation = census_deviation(results)
    sent_equal = all(sent == _formula(row, shape)[1] for row in results.rows for sent in row["wire_bytes"])
    rows = []
    for row in results.rows:
        saved, sent = _formula(row, shape)
        rows.append([row["method"], row["layout"], row["cp"], row["seq_len"],
                     f"{max(row['saved_bytes']) / 1024:,.1f}", f"{saved / 1024:,.1f}",
                     f"{max(row['seconds']) * 1e3:,.2f}", f"{max(row['wire_bytes']) / 1024:,.1f}",
                     f"{sent / 1024:,.1f}"])
    out = [f"### Context parallelism — memory per rank and step time against sequence length, {results.machine}", "",
           f"Causal attention, batch {shape.batch} x {shape.heads} heads x {shape.head_dim}, fp32, tiles of "
           f"{shape.block}; forward + backward, median of {shape.repeats}, slowest rank; ranks on gloo, one thread "
           "each. Memory: what autograd keeps for backward beyond q, k, v (census, fullest rank) beside the "
           "formula.", "",
           markdown_table(["method", "layout", "cp", "sequence", "kept KiB/rank", "formula KiB", "fwd+bwd ms",
                           "sent KiB/rank", "formula KiB"], rows, "lllrrrrrr"), "",
           f"Census vs formula, largest deviation: {deviation:.1%} ({'within' if deviation <= 0.05 else 'NOT within'} "
           f"5%); bytes sent vs formula: {'equal on every rank' if sent_equal else 'DIFFERENT'}"]
    longest = max(c.seq_lens)
    balance = []
    for row in results.rows:
        if row["method"] == "ring" and row["seq_len"] == longest:
            entries = row["entries"]
            computing = row["compute_seconds"]
            balance.append([row["layout"], row["cp"], ", ".join(f"{e:,}" for e in entries),
                            f"{max(entries) / min(entries):.2f} : 1", f"{2 * row['cp'] - 1} : 1",
                            ", ".join(f"{t * 1e3:,.2f}" for t in computing),
                            f"{max(computing) / min(computing):.2f} : 1", f"{max(row['seconds']) * 1e3:,.2f}"])
    out += ["", f"### Causal work per rank, ring attention at sequence {longest}, {results.machine}", "",
            markdown_table(["layout", "cp", "score entries per rank (forward)", "largest : smallest",
                            "2·cp − 1", "forward compute ms per rank", "largest : smallest", "fwd+bwd ms"],
                           balance, "lrlrrlrr"), "",
            "Compute: each rank's tile loops alone, without the waits. Every ring step waits for the slowest rank, "
            "so the contiguous split's imbalance shows in its step time against zig-zag's, not in the ranks' "
            "step times."]
    return "\n".join(out + [""] + _hiding(results))


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m parallel_lib.bench context [--quick] [--cps 2,4] [--seq-lens 128,256]``; prints the tables."""
    parser = argparse.ArgumentParser(prog="python -m parallel_lib.bench context", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short sequences, cp 2, one repeat: a smoke run")
    parser.add_argument("--cps", help="comma-separated cp sizes (default 2,4)")
    parser.add_argument("--seq-lens", help="comma-separated sequence lengths (default 128,256,512,1024)")
    args = parser.parse_args(argv)
    config = QUICK if args.quick else Config()
    if args.cps:
        config = replace(config, cps=tuple(int(x) for x in args.cps.split(",")))
    if args.seq_lens:
        config = replace(config, seq_lens=tuple(int(x) for x in args.seq_lens.split(",")))
    print(markdown(measure(config)))
    return 0
