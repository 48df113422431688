"""Goodput: requests per second that met their latency targets, not tokens per second of any quality.

Throughput counts every token, however late. A user waiting for a chat reply cares about two
latencies: the time to the first token (TTFT: the reply starts) and the time per output token after
it (TPOT: the reply streams at reading speed). A service level objective (SLO) bounds both; a
request that misses either is, to its user, a failure. DistServe (Zhong et al. 2024, "DistServe:
Disaggregating Prefill and Decoding for Goodput-optimized Large Language Model Serving") measures
an engine by its *goodput*: requests that met both targets, per second of the run. An engine that
batches harder can raise throughput and lower goodput at once (its prefills stall the decodes:
TPOT misses), which is why prefill/decode disaggregation (:mod:`.disaggregated`) is judged by it.

A request with one token has no TPOT: only its TTFT counts. A failed request never meets its SLO.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from parallel_lib.common.checks import positive_number
from parallel_lib.inference.batch import Result

__all__ = ["Goodput", "goodput"]


@dataclass(frozen=True)
class Goodput:
    """How many requests met a (TTFT, TPOT) target, and at what rate.

    Attributes:
        ttft_slo, tpot_slo: the targets (seconds).
        requests: requests in the run.
        met: requests that met both (TTFT alone for a one-token request).
        seconds: the run's span, first arrival to last token.
    """

    ttft_slo: float
    tpot_slo: float
    requests: int
    met: int
    seconds: float

    @property
    def per_second(self) -> float:
        """Goodput: requests meeting the targets per second of the run."""
        return self.met / self.seconds

    @property
    def attainment(self) -> float:
        """The share of requests that met the targets (SLO attainment)."""
        return self.met / self.requests


def goodput(results: Sequence[Result], ttft_slo: float, tpot_slo: float) -> Goodput:
    """Requests of ``results`` meeting TTFT <= ``ttft_slo`` and TPOT <= ``tpot_slo`` (see the module docstring).

    Args:
        results: a run's results, on one clock (arrival and token times).
        ttft_slo, tpot_slo: the targets in seconds.

    Returns:
        the count and rate.

    Raises:
        ValueError: a target not > 0, or no result with tokens (a run's span is undefined).
    """
    positive_number("ttft_slo", ttft_slo), positive_number("tpot_slo", tpot_slo)
    served = [r for r in results if r.ok and r.token_times]
    if not served:
        raise ValueError("results must hold at least one request that got tokens")
    met = sum(1 for r in served if r.ttft <= ttft_slo and (math.isnan(r.tpot) or r.tpot <= tpot_slo))
    seconds = max(r.token_times[-1] for r in served) - min(r.arrival for r in results)
    return Goodput(float(ttft_slo), float(tpot_slo), len(results), met, seconds)
