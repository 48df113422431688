"""Chapter 13's benchmark: one seeded request trace through static batching and continuous batching.

``python -m parallel_lib.bench serving [--quick]`` draws a trace (Poisson arrivals, mixed prompt and
output lengths, :func:`~parallel_lib.serving.trace.poisson_trace`) and replays it, in this one run,
through chapter 09's engine (static groups, ``max_len`` reserved per row) and chapter 13's (paged
KV cache, continuous batching; then with chunked prefill too) with the *same* KV memory: the paged
pool holds exactly the slots the static engine reserves. It prints throughput, time to first token,
time per output token and latency (p50 and p99), and whether every engine gave every request the
same tokens (they must: greedy). A second trace puts one shared system prompt in front of the same
requests and serves it without and with prefix caching: the hit rate and the time to first token it
saves.

The numbers are this machine's, measured in real time: a loaded CPU slows both alike, and the
trace's rate decides how busy the engines are. Torch runs on ``--threads`` intra-op threads (1 by
default: on a shared CPU more threads mostly wait for each other).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import Optional

import torch

from parallel_lib.common.checks import positive_int, positive_number
from parallel_lib.common.tables import markdown_table
from parallel_lib.inference import Engine, ServeConfig
from parallel_lib.runtime.environment import machine_label
from parallel_lib.serving import (ServingEngine, TraceMetrics, poisson_trace, replay_continuous, replay_static,
                                  trace_metrics)

__all__ = ["Config", "QUICK", "Results", "measure", "markdown", "main"]


@dataclass(frozen=True)
class Config:
    """The trace and the engines' limits."""

    requests: int = 64
    rate: float = 100.0
    prompt_lengths: tuple[int, int] = (4, 32)
    output_lengths: tuple[int, int] = (1, 96)
    max_batch: int = 16
    block_size: int = 16
    seed: int = 0
    threads: int = 1
    model: str = "tiny"
    max_step_tokens: int = 32
    shared_prefix: int = 32


QUICK = Config(requests=8, rate=200.0, prompt_lengths=(2, 12), output_lengths=(1, 8), max_batch=4, block_size=4,
               max_step_tokens=6, shared_prefix=8)


@dataclass
class Results:
    """Each engine's metrics, the machine, the pool and whether the tokens agreed."""

    config: Config
    machine: str
    metrics: dict[str, TraceMetrics]
    same_tokens: bool
    kv_slots: int
    preemptions: int
    prefix: dict[str, TraceMetrics]
    hit_rate: float


def shared_outputs(config: Config) -> tuple[int, int]:
    """The output lengths of the shared-prefix trace: the trace's, cut so that prefix + prompt + output fit 128."""
    low, high = config.output_lengths
    return low, max(low, min(high, 128 + 1 - config.shared_prefix - config.prompt_lengths[1]))


def measure(config: Config) -> Results:
    """Replay one trace through both engines (see the module docstring)."""
    positive_int("threads", config.threads)
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        serve = ServeConfig(model=config.model)
        model = serve.build()
        trace = poisson_trace(config.requests, config.rate, config.prompt_lengths, config.output_lengths,
                              serve.vocab_size, config.seed)
        max_len = max(a.request.slots for a in trace)
        static = Engine.single(model, max_batch=config.max_batch, max_len=max_len)
        slots = config.max_batch * max_len  # the static engine's reservation, the paged pool's size
        pool = dict(num_blocks=max(1, slots // config.block_size), block_size=config.block_size,
                    max_batch=config.max_batch)
        paged = ServingEngine(model, **pool)
        chunked = ServingEngine(model, **pool, max_step_tokens=config.max_step_tokens)
        s = replay_static(static, trace)
        c = replay_continuous(paged, trace)
        k = replay_continuous(chunked, trace)
        # a shared system prompt: the same trace's requests behind one prefix, without and with prefix caching
        shared = poisson_trace(config.requests, config.rate, config.prompt_lengths, shared_outputs(config),
                               serve.vocab_size, config.seed, config.shared_prefix)
        pool["num_blocks"] = max(1, config.max_batch * max(a.request.slots for a in shared) // config.block_size)
        plain, cached = ServingEngine(model, **pool), ServingEngine(model, **pool, prefix_caching=True)
        p = replay_continuous(plain, shared)
        q = replay_continuous(cached, shared)
    finally:
        torch.set_num_threads(threads)
    metrics = {"static (chapter 09)": trace_metrics(s), "continuous, paged (chapter 13)": trace_metrics(c),
               f"+ chunked prefill ({config.max_step_tokens} tokens/step)": trace_metrics(k)}
    prefix = {"continuous, paged": trace_metrics(p), "+ prefix caching": trace_metrics(q)}
    same = ([r.tokens for r in s] == [r.tokens for r in c] == [r.tokens for r in k]
            and [r.tokens for r in p] == [r.tokens for r in q])
    return Results(config, machine_label(), metrics, same, slots, paged.preemptions + chunked.preemptions, prefix,
                   cached.blocks.hit_rate)


def _row(name: str, m: TraceMetrics) -> list:
    ms = lambda x: f"{1e3 * x:.1f}"  # noqa: E731
    return [name, m.requests, m.tokens, f"{m.throughput:.1f}", ms(m.ttft_p50), ms(m.ttft_p99), ms(m.tpot_p50),
            ms(m.tpot_p99), ms(m.latency_p50), ms(m.latency_p99)]


def markdown(results: Results) -> str:
    """The tables and a line per ratio."""
    c = results.config
    table = markdown_table(["engine", "requests", "tokens", "tokens/s", "TTFT p50 ms", "TTFT p99 ms",
                            "TPOT p50 ms", "TPOT p99 ms", "latency p50 ms", "latency p99 ms"],
                           [_row(name, m) for name, m in results.metrics.items()])
    static, cont, chunked = results.metrics.values()
    plain, cached = results.prefix.values()
    prefix_table = markdown_table(["engine", "requests", "tokens", "tokens/s", "TTFT p50 ms", "TTFT p99 ms",
                                   "TPOT p50 ms", "TPOT p99 ms", "latency p50 ms", "latency p99 ms"],
                                  [_row(name, m) for name, m in results.prefix.items()])
    return (f"Serving a trace of {c.requests} requests (Poisson, {c.rate:g}/s, prompts {c.prompt_lengths[0]}-"
            f"{c.prompt_lengths[1]}, outputs {c.output_lengths[0]}-{c.output_lengths[1]} tokens, seed {c.seed}), "
            f"GPT-2 {c.model}, max_batch {c.max_batch}, {results.kv_slots} KV slots each "
            f"(paged: blocks of {c.block_size}), {c.threads} thread(s), on {results.machine}\n\n{table}\n\n"
            f"- continuous / static: {cont.throughput / static.throughput:.2f}× throughput, median latency "
            f"{cont.latency_p50 / static.latency_p50:.2f}×, median TTFT {cont.ttft_p50 / static.ttft_p50:.2f}×\n"
            f"- chunked prefill: TPOT p99 {1e3 * chunked.tpot_p99:.1f} ms against {1e3 * cont.tpot_p99:.1f} ms "
            f"with whole prompts\n"
            f"- preemptions: {results.preemptions}; same tokens for every request: "
            f"{'yes' if results.same_tokens else 'NO'}\n\n"
            f"The same arrivals behind one shared {c.shared_prefix}-token system prompt (outputs "
            f"{shared_outputs(c)[0]}-{shared_outputs(c)[1]} tokens):\n\n{prefix_table}\n\n"
            f"- prefix caching: {100 * results.hit_rate:.0f} % of prompt blocks taken from the cache, median TTFT "
            f"{plain.ttft_p50 * 1e3:.1f} -> {cached.ttft_p50 * 1e3:.1f} ms")


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m parallel_lib.bench serving [--quick] [--requests N] [--rate R] [--seed S] [--threads T]``."""
    parser = argparse.ArgumentParser(prog="python -m parallel_lib.bench serving", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 short requests: a smoke run")
    parser.add_argument("--requests", type=int, help="requests in the trace (default 64)")
    parser.add_argument("--rate", type=float, help="mean arrivals per second (default 100)")
    parser.add_argument("--seed", type=int, help="the trace's seed (default 0)")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default 1)")
    args = parser.parse_args(argv)
    config = QUICK if args.quick else Config()
    for field in ("requests", "rate", "seed", "threads"):
        if getattr(args, field) is not None:
            config = replace(config, **{field: getattr(args, field)})
    positive_number("rate", config.rate)
    print(markdown(measure(config)))
    return 0
