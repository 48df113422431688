"""Chapter 13's benchmark: one seeded request trace through static batching and continuous batching.

``python -m parallel_lib.bench serving [--quick]`` draws a trace (Poisson arrivals, mixed prompt
lengths, output lengths log-uniform: most answers short, a few long, as in chat traffic,
:func:`~parallel_lib.serving.trace.poisson_trace`) and replays it, in this one run,
through chapter 09's engine (static groups, ``max_len`` reserved per row) and chapter 13's (paged
KV cache, continuous batching; then with chunked prefill too) with the *same* KV memory: the paged
pool holds exactly the slots the static engine reserves. It prints throughput, time to first token,
time per output token and latency (p50 and p99), and whether every engine gave every request the
same tokens (they must: greedy). A second trace puts one shared system prompt in front of the same
requests and serves it without and with prefix caching: the hit rate and the time to first token it
saves. Last, speculative decoding (:mod:`~parallel_lib.serving.speculative`): the trace's first
requests one at a time (batch 1, where a pass is cheapest to spend on guesses), by the target alone and
with a draft made of its first layer guessing ``k`` tokens: acceptance rate, tokens per target pass,
speed-up, and whether the tokens are the target's.

Static and continuous batching replay the trace ``repeats`` times, alternately; the table shows each
engine's fastest replay (on a shared machine the load moves between runs, and the fastest run is the
least disturbed one) and the text the ratio within each pair.

The arrival rate is above what either engine serves, so requests queue and throughput is each
engine's own capacity on this machine. Static batching's loss is the output-length spread: a group
runs until its longest request ends while its finished rows idle; continuous batching fills a
finished row at the next step. With uniform output lengths a group's longest request is about
twice its mean; with log-uniform ones, about four times.

The numbers are this machine's, measured in real time: a loaded CPU slows both alike, and the
trace's rate decides how busy the engines are. The throughput ratio is at most the ratio of forward
passes (printed): it falls short by what a continuous pass costs more than a static one (building
the block-table layout, the paged gather, a prompt beside the decodes in many passes). On GPT-2
"tiny" (the default, 4 layers of 64) a pass costs mostly Python and dispatch; ``--model small`` (6
layers of 256) is closer to real serving, where a pass costs arithmetic. Torch runs on ``--threads`` intra-op threads (1 by
default: on a shared CPU more threads mostly wait for each other).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace
from typing import Optional

import torch

from parallel_lib.common.checks import positive_int, positive_number
from parallel_lib.common.tables import markdown_table
from parallel_lib.inference import Engine, ServeConfig
from parallel_lib.runtime.environment import machine_label
from parallel_lib.serving import (ServingEngine, SpeculativeDecoder, TraceMetrics, draft_from_target, poisson_trace,
                                  replay_continuous, replay_static, trace_metrics)

__all__ = ["Config", "QUICK", "SpeculativeRow", "Results", "measure", "markdown", "main"]


@dataclass(frozen=True)
class Config:
    """The trace and the engines' limits."""

    requests: int = 160
    rate: float = 400.0
    prompt_lengths: tuple[int, int] = (4, 32)
    output_lengths: tuple[int, int] = (1, 96)
    outputs: str = "log-uniform"
    max_batch: int = 16
    block_size: int = 16
    seed: int = 0
    threads: int = 1
    model: str = "tiny"
    max_step_tokens: int = 32
    shared_prefix: int = 32
    repeats: int = 3
    speculative_requests: int = 8
    k: int = 4
    draft_layers: int = 1


QUICK = Config(requests=8, rate=200.0, prompt_lengths=(2, 12), output_lengths=(1, 8), max_batch=4, block_size=4,
               max_step_tokens=6, shared_prefix=8, repeats=1, speculative_requests=2, k=2)


@dataclass(frozen=True)
class SpeculativeRow:
    """Speculative decoding against the target alone on the same requests (batch 1)."""

    k: int
    tokens: int
    baseline_seconds: float
    seconds: float
    acceptance_rate: float
    tokens_per_pass: float
    same_tokens: bool

    @property
    def speedup(self) -> float:
        return self.baseline_seconds / self.seconds


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
    speculative: SpeculativeRow
    passes: tuple[int, int]
    ratios: list[float]


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
                              serve.vocab_size, config.seed, outputs=config.outputs)
        max_len = max(a.request.slots for a in trace)
        slots = config.max_batch * max_len  # the static engine's reservation, the paged pool's size
        pool = dict(num_blocks=max(1, slots // config.block_size), block_size=config.block_size,
                    max_batch=config.max_batch)
        pairs = []  # static then continuous, `repeats` times: a shared machine's load moves between runs
        for _ in range(config.repeats):
            static = Engine.single(model, max_batch=config.max_batch, max_len=max_len)
            paged = ServingEngine(model, **pool)
            pairs.append(((static, replay_static(static, trace)), (paged, replay_continuous(paged, trace))))
        fastest = lambda runs: max(runs, key=lambda run: trace_metrics(run[1]).throughput)  # noqa: E731
        (static, s), (paged, c) = fastest([p[0] for p in pairs]), fastest([p[1] for p in pairs])
        ratios = [trace_metrics(b[1]).throughput / trace_metrics(a[1]).throughput for a, b in pairs]
        chunked = ServingEngine(model, **pool, max_step_tokens=config.max_step_tokens)
        k = replay_continuous(chunked, trace)
        # a shared system prompt: the same trace's requests behind one prefix, without and with prefix caching
        shared = poisson_trace(config.requests, config.rate, config.prompt_lengths, shared_outputs(config),
                               serve.vocab_size, config.seed, config.shared_prefix, outputs=config.outputs)
        pool["num_blocks"] = max(1, config.max_batch * max(a.request.slots for a in shared) // config.block_size)
        plain, cached = ServingEngine(model, **pool), ServingEngine(model, **pool, prefix_caching=True)
        p = replay_continuous(plain, shared)
        q = replay_continuous(cached, shared)
        spec = _speculative(model, config, [a.request for a in trace[:config.speculative_requests]],
                            [r.tokens for r in s[:config.speculative_requests]])
    finally:
        torch.set_num_threads(threads)
    metrics = {"static (chapter 09)": trace_metrics(s), "continuous, paged (chapter 13)": trace_metrics(c),
               f"+ chunked prefill ({config.max_step_tokens} tokens/step)": trace_metrics(k)}
    prefix = {"continuous, paged": trace_metrics(p), "+ prefix caching": trace_metrics(q)}
    same = ([r.tokens for r in s] == [r.tokens for r in c] == [r.tokens for r in k]
            and [r.tokens for r in p] == [r.tokens for r in q])
    return Results(config, machine_label(), metrics, same, slots, paged.preemptions + chunked.preemptions, prefix,
                   cached.blocks.hit_rate, spec, (static_passes(static, s), len(paged.records)), ratios)


def static_passes(engine: Engine, results: list) -> int:
    """Forward passes chapter 09's engine made: per group, one per token of its longest request (the first
    token comes from the prefill pass)."""
    by_index = {r.index: r for r in results}
    return sum(max(len(by_index[i].tokens) for i in group) for group in engine.groups)


def _speculative(model, config: Config, requests: list, expected: list[list[int]]) -> SpeculativeRow:
    """The requests one at a time by the target alone (k = 0) and with the draft guessing ``k`` (same code path)."""
    draft = draft_from_target(model, config.draft_layers)
    timed = []
    for k in (0, config.k):
        decoder = SpeculativeDecoder(model, draft, k=k, block_size=config.block_size, max_batch=1)
        start = time.perf_counter()
        tokens = [r.tokens for r in decoder.run(requests)]
        timed.append((time.perf_counter() - start, tokens, decoder.stats))
    (base, base_tokens, _), (seconds, tokens, stats) = timed
    return SpeculativeRow(config.k, stats.tokens, base, seconds, stats.acceptance_rate, stats.tokens_per_round,
                          tokens == base_tokens == expected)


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
    sp = results.speculative
    spec_table = markdown_table(["decoding (batch 1)", "tokens", "tokens/s", "acceptance", "tokens per target pass",
                                 "speed-up", "target's tokens"],
                                [["target alone", sp.tokens, f"{sp.tokens / sp.baseline_seconds:.1f}", "-", "1.00",
                                  "1.00×", "yes"],
                                 [f"speculative, k={sp.k}, draft: first {c.draft_layers} layer(s)", sp.tokens,
                                  f"{sp.tokens / sp.seconds:.1f}", f"{100 * sp.acceptance_rate:.0f} %",
                                  f"{sp.tokens_per_pass:.2f}", f"{sp.speedup:.2f}×",
                                  "yes" if sp.same_tokens else "NO"]])
    return (f"Serving a trace of {c.requests} requests (Poisson, {c.rate:g}/s, prompts {c.prompt_lengths[0]}-"
            f"{c.prompt_lengths[1]}, outputs {c.output_lengths[0]}-{c.output_lengths[1]} tokens {c.outputs}, "
            f"seed {c.seed}), "
            f"GPT-2 {c.model}, max_batch {c.max_batch}, {results.kv_slots} KV slots each "
            f"(paged: blocks of {c.block_size}), {c.threads} thread(s), on {results.machine}\n\n{table}\n\n"
            f"- continuous / static: {cont.throughput / static.throughput:.2f}× throughput, median latency "
            f"{cont.latency_p50 / static.latency_p50:.2f}×, median TTFT {cont.ttft_p50 / static.ttft_p50:.2f}× "
            f"(each engine's fastest of {c.repeats} alternated replays; throughput ratio in each pair: "
            f"{', '.join(f'{r:.2f}×' for r in results.ratios)})\n"
            f"- chunked prefill: TPOT p99 {1e3 * chunked.tpot_p99:.1f} ms against {1e3 * cont.tpot_p99:.1f} ms "
            f"with whole prompts\n"
            f"- forward passes: static {results.passes[0]} ({static.tokens / results.passes[0]:.1f} tokens each), "
            f"continuous {results.passes[1]} ({cont.tokens / results.passes[1]:.1f} tokens each): the throughput "
            f"ratio if a pass cost the same in both is {results.passes[0] / results.passes[1]:.2f}×\n"
            f"- preemptions: {results.preemptions}; same tokens for every request: "
            f"{'yes' if results.same_tokens else 'NO'}\n\n"
            f"The same arrivals behind one shared {c.shared_prefix}-token system prompt (outputs "
            f"{shared_outputs(c)[0]}-{shared_outputs(c)[1]} tokens):\n\n{prefix_table}\n\n"
            f"- prefix caching: {100 * results.hit_rate:.0f} % of prompt blocks taken from the cache, median TTFT "
            f"{plain.ttft_p50 * 1e3:.1f} -> {cached.ttft_p50 * 1e3:.1f} ms\n\n"
            f"Speculative decoding, the trace's first {c.speculative_requests} requests one at a time:\n\n"
            f"{spec_table}\n\n"
            f"- the acceptance rate is how often the draft guesses the target's token; on this randomly "
            f"initialised model it says how predictable its output is, not what a trained draft achieves")


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m parallel_lib.bench serving [--quick] [--requests N] [--rate R] [--seed S] [--threads T]
    [--outputs uniform|log-uniform] [--model tiny|small]``."""
    parser = argparse.ArgumentParser(prog="python -m parallel_lib.bench serving", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 short requests: a smoke run")
    parser.add_argument("--requests", type=int, help="requests in the trace (default 160)")
    parser.add_argument("--rate", type=float, help="mean arrivals per second (default 400)")
    parser.add_argument("--seed", type=int, help="the trace's seed (default 0)")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default 1)")
    parser.add_argument("--outputs", choices=["uniform", "log-uniform"], help="output lengths (default log-uniform)")
    parser.add_argument("--model", choices=["tiny", "small"], help="GPT-2 size (default tiny)")
    args = parser.parse_args(argv)
    config = QUICK if args.quick else Config()
    for field in ("requests", "rate", "seed", "threads", "outputs", "model"):
        if getattr(args, field) is not None:
            config = replace(config, **{field: getattr(args, field)})
    positive_number("rate", config.rate)
    print(markdown(measure(config)))
    return 0
