"""Chapter 13's benchmark: one seeded request trace through static batching, continuous batching and its features.

``python -m parallel_lib.bench serving [--quick]`` draws a trace (Poisson arrivals, mixed prompt
lengths, output lengths log-uniform: most answers short, a few long, as in chat traffic,
:func:`~parallel_lib.serving.trace.poisson_trace`) and replays it, in this one run,
through chapter 09's engine (static groups, ``max_len`` reserved per row) and chapter 13's (paged
KV cache, continuous batching; then with chunked prefill, and with speculative decoding) with the
*same* KV memory: the paged pool holds exactly the slots the static engine reserves. It prints
throughput, time to first token, time per output token and latency (p50 and p99), goodput (requests
per second that met a latency target: a TTFT and a TPOT bound), and whether every engine gave every
request the same tokens (they must: greedy). Each ``+`` row is the continuous engine with one feature
added; another engine's row is one more entry in :attr:`Results.runs` (its replay's results).

A second trace puts one shared system prompt in front of the same requests and serves it without
and with prefix caching: the hit rate and the time to first token it saves. Speculative decoding
(:mod:`~parallel_lib.serving.speculative`, a draft made of the target's first layer(s) guessing ``k``
tokens) runs twice: inside the continuous engine on the trace (acceptance rate, tokens per target
pass), and on the trace's first requests one at a time (batch 1, where a pass is cheapest to spend
on guesses) against the target alone: the speed-up.

Last, the HTTP endpoint (:mod:`~parallel_lib.serving.http`, on 127.0.0.1 in this process, over the
continuous engine with the same pool) is driven by the load generator (:mod:`~parallel_lib.serving.load`)
as clients drive it: ``http_clients`` concurrent streaming clients (at least 32), each sending the
trace's requests one after another as it gets its answers, with throughput, TTFT, TPOT and goodput
measured on the clients' clock (HTTP, JSON and the clients' threads included: they share this
interpreter with the engine's thread), every request accounted for (completed, refused, lost) and
its tokens compared with the engines'.

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
layers of 256) is closer to real serving, where a pass costs arithmetic. Torch runs on ``--threads``
intra-op threads (1 by default: on a shared CPU more threads mostly wait for each other).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from parallel_lib.bench import parse_config
from parallel_lib.common.checks import positive_int, positive_number
from parallel_lib.common.tables import markdown_table
from parallel_lib.inference import Engine, Request, Result, ServeConfig
from parallel_lib.runtime.environment import machine_label
from parallel_lib.serving import (ServingEngine, SpeculativeStats, TraceMetrics, draft_from_target, poisson_trace,
                                  replay_continuous, replay_static, trace_metrics)
from parallel_lib.serving.disaggregated import run_disaggregated
from parallel_lib.serving.goodput import goodput
from parallel_lib.serving.http import CompletionServer
from parallel_lib.serving.load import LoadReport, markdown as load_markdown, run_load

__all__ = ["Config", "QUICK", "SpeculativeRow", "HttpRun", "Results", "measure", "markdown", "main"]

STATIC, CONTINUOUS = "static (chapter 09)", "continuous, paged (chapter 13)"


@dataclass(frozen=True)
class Config:
    """The trace, the engines' limits, the HTTP load and the latency target (seconds) of goodput."""

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
    http_clients: int = 32
    http_requests: int = 160
    slo_ttft: float = 0.5
    slo_tpot: float = 0.025
    disaggregated: bool = True  # one prefill and one decode rank (a launch of 2 ranks)


QUICK = Config(requests=8, rate=200.0, prompt_lengths=(2, 12), output_lengths=(1, 8), max_batch=4, block_size=4,
               max_step_tokens=6, shared_prefix=8, repeats=1, speculative_requests=2, k=2, http_requests=32,
               disaggregated=False)  # its launch costs more than the whole smoke run; the serving tests run it


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
class HttpRun:
    """The endpoint driven by the load generator: its report, goodput, and whether the tokens were the engines'."""

    report: LoadReport
    goodput: float
    same_tokens: bool


@dataclass
class Results:
    """Each engine's results on the trace (a row each), the machine, the pool and whether the tokens agreed."""

    config: Config
    machine: str
    runs: dict[str, list[Result]]
    same_tokens: bool
    kv_slots: int
    preemptions: int
    prefix: dict[str, list[Result]]
    hit_rate: float
    speculative: SpeculativeRow
    speculation: SpeculativeStats
    passes: dict[str, int]
    ratios: list[float]
    http: HttpRun

    @property
    def metrics(self) -> dict[str, TraceMetrics]:
        """Each trace row's throughput and latencies."""
        return {name: trace_metrics(results) for name, results in self.runs.items()}


def shared_outputs(config: Config) -> tuple[int, int]:
    """The output lengths of the shared-prefix trace: the trace's, cut so that prefix + prompt + output fit 128."""
    low, high = config.output_lengths
    return low, max(low, min(high, 128 + 1 - config.shared_prefix - config.prompt_lengths[1]))


def chunked_name(config: Config) -> str:
    return f"+ chunked prefill ({config.max_step_tokens} tokens/step)"


DISAGGREGATED = "disaggregated (1 prefill + 1 decode rank, a pool each)"


def speculative_name(config: Config) -> str:
    return f"+ speculative decoding (k={config.k}, draft: first {config.draft_layers} layer(s))"


def measure(config: Config) -> Results:
    """Replay one trace through every engine, then drive the endpoint (see the module docstring)."""
    positive_int("threads", config.threads)
    positive_int("http_clients", config.http_clients)
    positive_number("slo_ttft", config.slo_ttft), positive_number("slo_tpot", config.slo_tpot)
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        serve = ServeConfig(model=config.model)
        model = serve.build()
        draft = draft_from_target(model, config.draft_layers)
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
        speculating = ServingEngine(model, **pool, draft=draft, k=config.k)
        # one row per engine on the trace; another engine's row is one more entry here
        runs = {STATIC: s, CONTINUOUS: c, chunked_name(config): replay_continuous(chunked, trace),
                speculative_name(config): replay_continuous(speculating, trace)}
        if config.disaggregated:  # prefill on one rank, the KV blocks sent to a decode rank (its own pool)
            runs[DISAGGREGATED] = run_disaggregated(model, trace, **pool).results
        passes = {STATIC: static_passes(static, s), CONTINUOUS: paged.steps, speculative_name(config):
                  speculating.steps}
        http = _http(model, config, pool, [a.request for a in trace], [r.tokens for r in s])
        # a shared system prompt: the same trace's requests behind one prefix, without and with prefix caching
        shared = poisson_trace(config.requests, config.rate, config.prompt_lengths, shared_outputs(config),
                               serve.vocab_size, config.seed, config.shared_prefix, outputs=config.outputs)
        shared_pool = dict(pool, num_blocks=max(1, config.max_batch * max(a.request.slots for a in shared)
                                                // config.block_size))
        cached = ServingEngine(model, **shared_pool, prefix_caching=True)
        prefix = {"continuous, paged": replay_continuous(ServingEngine(model, **shared_pool), shared),
                  "+ prefix caching": replay_continuous(cached, shared)}
        spec = _speculative(model, draft, config, [a.request for a in trace[:config.speculative_requests]],
                            [r.tokens for r in s[:config.speculative_requests]])
    finally:
        torch.set_num_threads(threads)
    tokens = [[r.tokens for r in results] for results in runs.values()]
    prefix_tokens = [[r.tokens for r in results] for results in prefix.values()]
    same = all(t == tokens[0] for t in tokens) and prefix_tokens[0] == prefix_tokens[1]
    return Results(config, machine_label(), runs, same, slots, paged.preemptions + chunked.preemptions, prefix,
                   cached.blocks.hit_rate, spec, speculating.drafter.stats, passes, ratios, http)


def static_passes(engine: Engine, results: list) -> int:
    """Forward passes chapter 09's engine made: per group, one per token of its longest request (the first
    token comes from the prefill pass)."""
    by_index = {r.index: r for r in results}
    return sum(max(len(by_index[i].tokens) for i in group) for group in engine.groups)


def _speculative(model, draft, config: Config, requests: list, expected: list[list[int]]) -> SpeculativeRow:
    """The requests one at a time by the target alone and with the draft guessing ``k`` (the same engine)."""
    num_blocks = -(-(max(r.slots for r in requests) + config.k) // config.block_size)
    timed = []
    for guesser in (None, draft):
        engine = ServingEngine(model, num_blocks, config.block_size, max_batch=1, draft=guesser, k=config.k)
        start = time.perf_counter()
        tokens = [r.tokens for r in engine.run(requests)]
        timed.append((time.perf_counter() - start, tokens, engine.drafter))
    (base, base_tokens, _), (seconds, tokens, drafter) = timed
    stats = drafter.stats
    return SpeculativeRow(config.k, stats.tokens, base, seconds, stats.acceptance_rate, stats.tokens_per_round,
                          tokens == base_tokens == expected)


def _http(model, config: Config, pool: dict, requests: list[Request], expected: list[list[int]]) -> HttpRun:
    """The continuous engine behind the endpoint on 127.0.0.1, driven by ``http_clients`` streaming clients
    sending ``http_requests`` of the trace's requests (in order, again from the first when they run out)."""
    n = len(requests)
    bodies = [{"model": "bench", "prompt": list(requests[i % n].prompt), "max_tokens": requests[i % n].max_new_tokens,
               "temperature": 0, "stream": True} for i in range(config.http_requests)]
    engine = ServingEngine(model, **pool)
    with CompletionServer(engine, model="bench", max_connections=max(64, 2 * config.http_clients)) as server:
        report = run_load("127.0.0.1", server.port, bodies, clients=config.http_clients)
    same = all(r.tokens == expected[i % n] for i, r in enumerate(report.results))
    return HttpRun(report, report.goodput(config.slo_ttft, config.slo_tpot), same)


def _row(name: str, results: list[Result], config: Config) -> list:
    m = trace_metrics(results)
    ms = lambda x: f"{1e3 * x:.1f}"  # noqa: E731
    return [name, m.requests, m.tokens, f"{m.throughput:.1f}", ms(m.ttft_p50), ms(m.ttft_p99), ms(m.tpot_p50),
            ms(m.tpot_p99), ms(m.latency_p50), ms(m.latency_p99),
            f"{goodput(results, config.slo_ttft, config.slo_tpot).per_second:.1f}"]


def _table(runs: dict[str, list[Result]], config: Config) -> str:
    return markdown_table(["engine", "requests", "tokens", "tokens/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
                           "TPOT p99 ms", "latency p50 ms", "latency p99 ms", "goodput req/s"],
                          [_row(name, results, config) for name, results in runs.items()])


def markdown(results: Results) -> str:
    """The tables and a line per ratio."""
    c = results.config
    metrics = results.metrics
    static, cont = metrics[STATIC], metrics[CONTINUOUS]
    chunked, speculative = metrics[chunked_name(c)], metrics[speculative_name(c)]
    plain, cached = (trace_metrics(r) for r in results.prefix.values())
    sp, st, http = results.speculative, results.speculation, results.http
    spec_table = markdown_table(["decoding (batch 1)", "tokens", "tokens/s", "acceptance", "tokens per target pass",
                                 "speed-up", "target's tokens"],
                                [["target alone", sp.tokens, f"{sp.tokens / sp.baseline_seconds:.1f}", "-", "1.00",
                                  "1.00×", "yes"],
                                 [f"speculative, k={sp.k}, draft: first {c.draft_layers} layer(s)", sp.tokens,
                                  f"{sp.tokens / sp.seconds:.1f}", f"{100 * sp.acceptance_rate:.0f} %",
                                  f"{sp.tokens_per_pass:.2f}", f"{sp.speedup:.2f}×",
                                  "yes" if sp.same_tokens else "NO"]])
    passes = ", ".join(f"{name.split(' (')[0]} {n} ({metrics[name].tokens / n:.1f} tokens each)"
                       for name, n in results.passes.items())
    slo = f"TTFT ≤ {1e3 * c.slo_ttft:g} ms and TPOT ≤ {1e3 * c.slo_tpot:g} ms"
    report = http.report
    return (f"Serving a trace of {c.requests} requests (Poisson, {c.rate:g}/s, prompts {c.prompt_lengths[0]}-"
            f"{c.prompt_lengths[1]}, outputs {c.output_lengths[0]}-{c.output_lengths[1]} tokens {c.outputs}, "
            f"seed {c.seed}), "
            f"GPT-2 {c.model}, max_batch {c.max_batch}, {results.kv_slots} KV slots each "
            f"(paged: blocks of {c.block_size}), {c.threads} thread(s), on {results.machine}; goodput: requests "
            f"per second with {slo}\n\n{_table(results.runs, c)}\n\n"
            f"- continuous / static: {cont.throughput / static.throughput:.2f}× throughput, median latency "
            f"{cont.latency_p50 / static.latency_p50:.2f}×, median TTFT {cont.ttft_p50 / static.ttft_p50:.2f}× "
            f"(each engine's fastest of {c.repeats} alternated replays; throughput ratio in each pair: "
            f"{', '.join(f'{r:.2f}×' for r in results.ratios)})\n"
            f"- chunked prefill: TPOT p99 {1e3 * chunked.tpot_p99:.1f} ms against {1e3 * cont.tpot_p99:.1f} ms "
            f"with whole prompts\n"
            f"- speculative decoding in the continuous engine: {100 * st.acceptance_rate:.0f} % of "
            f"{st.proposed} guesses accepted, {st.tokens_per_round:.2f} tokens per sequence and target pass, "
            f"{st.draft_passes} draft passes; throughput {speculative.throughput / cont.throughput:.2f}× "
            f"continuous\n"
            f"{_disaggregated_line(metrics, c)}"
            f"- forward passes (target): {passes}; static / continuous "
            f"{results.passes[STATIC] / results.passes[CONTINUOUS]:.2f}×, the throughput ratio if a pass cost "
            f"the same in both\n"
            f"- preemptions: {results.preemptions}; same tokens for every request: "
            f"{'yes' if results.same_tokens else 'NO'}\n\n"
            f"The same arrivals behind one shared {c.shared_prefix}-token system prompt (outputs "
            f"{shared_outputs(c)[0]}-{shared_outputs(c)[1]} tokens):\n\n{_table(results.prefix, c)}\n\n"
            f"- prefix caching: {100 * results.hit_rate:.0f} % of prompt blocks taken from the cache, median TTFT "
            f"{plain.ttft_p50 * 1e3:.1f} -> {cached.ttft_p50 * 1e3:.1f} ms\n\n"
            f"Speculative decoding, the trace's first {c.speculative_requests} requests one at a time:\n\n"
            f"{spec_table}\n\n"
            f"- the acceptance rate is how often the draft guesses the target's token; on this randomly "
            f"initialised model it says how predictable its output is, not what a trained draft achieves\n\n"
            f"The HTTP endpoint (127.0.0.1, the continuous engine) driven by {report.clients} concurrent streaming "
            f"clients sending {report.requests} of the trace's requests back to back:\n\n"
            f"{load_markdown(report, results.machine, (c.slo_ttft, c.slo_tpot))}\n\n"
            f"- goodput ({slo}): {http.goodput:.1f} requests/s; lost: {report.lost}; the engines' tokens: "
            f"{'yes' if http.same_tokens else 'NO'}")


def _disaggregated_line(metrics: dict[str, TraceMetrics], config: Config) -> str:
    if DISAGGREGATED not in metrics:
        return ""
    d, c = metrics[DISAGGREGATED], metrics[CONTINUOUS]
    return (f"- disaggregated / continuous (two processes against one thread; each rank has a pool of the same "
            f"size): TTFT p50 {d.ttft_p50 / c.ttft_p50:.2f}×, TPOT p50 {d.tpot_p50 / c.tpot_p50:.2f}×, "
            f"throughput {d.throughput / c.throughput:.2f}×\n")


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m parallel_lib.bench serving [--quick] [--requests N] [--rate R] [--seed S] [--threads T]
    [--outputs uniform|log-uniform] [--model tiny|small] [--clients C] [--no-disaggregated]``."""
    config, _ = parse_config(argv, "serving", __doc__, QUICK, Config, "8 short requests: a smoke run", [
        ("--requests", {"type": int, "help": "requests in the trace (default 160)"}),
        ("--rate", {"type": float, "help": "mean arrivals per second (default 400)"}),
        ("--seed", {"type": int, "help": "the trace's seed (default 0)"}),
        ("--threads", {"type": int, "help": "torch intra-op threads (default 1)"}),
        ("--outputs", {"choices": ["uniform", "log-uniform"], "help": "output lengths (default log-uniform)"}),
        ("--model", {"choices": ["tiny", "small"], "help": "GPT-2 size (default tiny)"}),
        ("--clients", {"type": int, "dest": "http_clients", "help": "concurrent HTTP clients (default 32)"}),
        ("--no-disaggregated", {"action": "store_false", "dest": "disaggregated", "default": None,
                                "help": "skip the disaggregated row (a launch of 2 ranks)"})])
    positive_number("rate", config.rate)
    print(markdown(measure(config)))
    return 0
