"""A request trace and its replay: the same arrivals through static batching and continuous batching.

A trace is a seeded list of :class:`Arrival` (time, request): arrivals of a Poisson process (gaps
drawn from an exponential distribution of mean ``1 / rate``), prompt lengths drawn uniformly from a
range and output lengths uniformly or *log-uniformly* (``outputs="log-uniform"``: as many requests
between 1 and 10 tokens as between 10 and 100, a long tail like chat traffic's, where most answers
are short and a few are long), so short and long requests mix. That mix is the case where static
batching loses most: a static group runs until its longest request ends, its finished rows idle,
while continuous batching gives a finished row's place to the next request at once.

Both replays run in real time on one clock starting at the first arrival: a request cannot be
served before it arrives, and the engine sleeps when it has nothing to do.

- :func:`replay_static`: chapter 09's :class:`~parallel_lib.inference.Engine`. When it is free it
  takes every request that has arrived (up to ``max_batch``) as one group and serves the group to
  its end; requests arriving meanwhile wait for the next group.
- :func:`replay_continuous`: chapter 13's :class:`~parallel_lib.serving.engine.ServingEngine`,
  which adds arrived requests before every step.

:func:`trace_metrics` reads the results: throughput (generated tokens per second from the first
arrival to the last token), time to first token, time per output token and end-to-end latency,
each as its median and 99th percentile.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from parallel_lib.common.checks import check_choice, check_int, positive_int, positive_number
from parallel_lib.inference.batch import Request, Result
from parallel_lib.inference.engine import Engine
from parallel_lib.serving.engine import ServingEngine

__all__ = ["Arrival", "poisson_trace", "replay_static", "replay_continuous", "TraceMetrics", "trace_metrics"]


@dataclass(frozen=True)
class Arrival:
    """A request and when it arrives (seconds after the trace starts)."""

    time: float
    request: Request


def _length_range(name: str, value: tuple[int, int]) -> tuple[int, int]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(f"{name} must be a (low, high) pair of ints, got {value!r}")
    low, high = positive_int(f"{name}[0]", value[0]), positive_int(f"{name}[1]", value[1])
    if low > high:
        raise ValueError(f"{name} must be (low, high) with low <= high, got {tuple(value)}")
    return low, high


def poisson_trace(n: int, rate: float, prompt_lengths: tuple[int, int], output_lengths: tuple[int, int],
                  vocab_size: int, seed: int = 0, shared_prefix: int = 0, outputs: str = "uniform") -> list[Arrival]:
    """``n`` requests arriving as a Poisson process of ``rate`` per second, lengths drawn in their ranges.

    Args:
        n: requests.
        rate: mean arrivals per second.
        prompt_lengths, output_lengths: (low, high) inclusive ranges of prompt tokens and new tokens.
        vocab_size: prompt tokens are drawn from ``0 .. vocab_size - 1``.
        seed: the trace's seed (the same seed gives the same trace).
        shared_prefix: tokens of one "system prompt" put in front of every prompt (0: none); the
            prompt lengths count the tokens after it.
        outputs: "uniform" (every output length in the range alike) or "log-uniform" (the logarithm of
            the length uniform: short outputs common, long ones rare; see the module docstring).

    Raises:
        ValueError, TypeError: a count below 1, a rate not > 0, a range that is not (low <= high), an
            unknown ``outputs``.
    """
    check_choice("outputs", outputs, ("uniform", "log-uniform"))
    positive_int("n", n), positive_number("rate", rate), positive_int("vocab_size", vocab_size)
    check_int("seed", seed, minimum=0), check_int("shared_prefix", shared_prefix, minimum=0)
    (p_lo, p_hi), (o_lo, o_hi) = _length_range("prompt_lengths", prompt_lengths), _length_range("output_lengths",
                                                                                               output_lengths)
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, vocab_size, (shared_prefix,), generator=g).tolist()
    gaps = torch.empty(n, dtype=torch.float64).exponential_(rate, generator=g)
    times = (gaps.cumsum(0) - gaps[0]).tolist()  # the first request arrives at 0
    out = []
    for t in times:
        length = int(torch.randint(p_lo, p_hi + 1, (), generator=g))
        prompt = torch.randint(0, vocab_size, (length,), generator=g).tolist()
        if outputs == "uniform":
            new = int(torch.randint(o_lo, o_hi + 1, (), generator=g))
        else:  # exp of a uniform log: floor(exp(U[log lo, log(hi + 1)))) lies in lo .. hi
            u = float(torch.rand((), generator=g, dtype=torch.float64))
            new = min(o_hi, int(math.exp(math.log(o_lo) + u * (math.log(o_hi + 1) - math.log(o_lo)))))
        out.append(Arrival(t, Request(system + prompt, new)))
    return out


def _wait_until(start: float, t: float) -> None:
    delay = start + t - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def replay_static(engine: Engine, trace: Sequence[Arrival]) -> list[Result]:
    """Serve ``trace`` with chapter 09's static batches (see the module docstring); times on the trace's clock."""
    results: list[Result] = []
    start, nxt = time.perf_counter(), 0
    while nxt < len(trace):
        _wait_until(start, trace[nxt].time)
        now = time.perf_counter() - start
        chosen = [i for i in range(nxt, len(trace)) if trace[i].time <= now][:engine.max_batch]
        nxt = chosen[-1] + 1
        offset = time.perf_counter() - start - engine.recorder.now()  # engine clock -> trace clock
        group = engine.generate([trace[i].request for i in chosen], chosen)
        for i, result in zip(chosen, group):
            result.arrival = trace[i].time
            result.token_times = [t + offset for t in result.token_times]
            results.append(result)
    return results


def replay_continuous(engine: ServingEngine, trace: Sequence[Arrival]) -> list[Result]:
    """Serve ``trace`` with continuous batching (see the module docstring); times on the trace's clock."""
    first = len(engine.results)
    base, nxt = engine.now(), 0
    while nxt < len(trace) or not engine.idle():
        if engine.idle():
            _wait_until(time.perf_counter() - (engine.now() - base), trace[nxt].time)
        while nxt < len(trace) and trace[nxt].time <= engine.now() - base:
            engine.add(trace[nxt].request, first + nxt, base + trace[nxt].time)
            nxt += 1
        engine.step()
    results = [engine.results[first + i] for i in range(len(trace))]
    for r in results:  # onto the trace's clock
        r.arrival -= base
        r.token_times = [t - base for t in r.token_times]
    return results


def _percentile(values: list[float], q: float) -> float:
    values = sorted(v for v in values if not math.isnan(v))
    if not values:
        return math.nan
    return float(torch.quantile(torch.tensor(values, dtype=torch.float64), q))


@dataclass(frozen=True)
class TraceMetrics:
    """What a replay achieved (seconds; throughput in generated tokens per second)."""

    requests: int
    tokens: int
    makespan: float
    throughput: float
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    latency_p50: float
    latency_p99: float


def trace_metrics(results: Sequence[Result]) -> TraceMetrics:
    """Throughput and latency percentiles of a replay's results (see the module docstring).

    Raises:
        ValueError: no result with tokens.
    """
    done = [r for r in results if r.ok and r.token_times]
    if not done:
        raise ValueError("results must hold at least one request that got tokens")
    tokens = sum(len(r.tokens) for r in done)
    makespan = max(r.token_times[-1] for r in done) - min(r.arrival for r in done)
    latency = [r.token_times[-1] - r.arrival for r in done]
    return TraceMetrics(len(done), tokens, makespan, tokens / makespan,
                        _percentile([r.ttft for r in done], 0.5), _percentile([r.ttft for r in done], 0.99),
                        _percentile([r.tpot for r in done], 0.5), _percentile([r.tpot for r in done], 0.99),
                        _percentile(latency, 0.5), _percentile(latency, 0.99))
