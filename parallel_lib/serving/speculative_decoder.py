"""Speculative decoding of a list of requests in one call: the serving engine with a draft, sized for them.

:class:`SpeculativeDecoder` is the short way to run :mod:`.speculative` on some requests and read
what the guessing did (``decoder.stats``): each :meth:`~SpeculativeDecoder.run` builds a
:class:`~parallel_lib.serving.engine.ServingEngine` with the draft, a pool large enough for
``max_batch`` of the requests with their ``k`` lookahead slots (so no request waits for blocks),
and serves them continuously, ``max_batch`` at a time. ``k = 0`` is the target alone through the same
code path: the baseline a speed-up is measured against.
"""

from __future__ import annotations

from typing import Any, Sequence as Seq

from parallel_lib.common.checks import check_int, positive_int
from parallel_lib.inference.batch import Request, Result, check_requests
from parallel_lib.models.hf import as_gpt2
from parallel_lib.serving.block_manager import blocks_for
from parallel_lib.serving.engine import ServingEngine
from parallel_lib.serving.speculative import SpeculativeStats

__all__ = ["SpeculativeDecoder"]


class SpeculativeDecoder:
    """Speculative decoding of a target GPT-2 with a draft GPT-2; see the module docstring.

    Args:
        target, draft: the one GPT-2 or Hugging Face ``GPT2LMHeadModel`` each (converted once), with
            the same vocabulary and device.
        k: guesses per sequence and step at most (0: the target alone, one token per pass).
        block_size: token slots per block of both pools.
        max_batch: requests decoded together at most.

    Attributes:
        stats: the :class:`~parallel_lib.serving.speculative.SpeculativeStats` of everything served so far.

    Raises:
        ValueError: ``k`` below 0, a count below 1, or a draft whose vocabulary or device is not the target's.
    """

    def __init__(self, target: Any, draft: Any, k: int = 4, block_size: int = 16, max_batch: int = 8) -> None:
        self.target, self.draft = as_gpt2(target).eval(), as_gpt2(draft).eval()
        self.k = check_int("k", k, minimum=0)
        self.block_size, self.max_batch = positive_int("block_size", block_size), positive_int("max_batch", max_batch)
        ServingEngine(self.target, 1, self.block_size, self.max_batch, draft=self.draft, k=self.k)  # checks the draft
        self.stats = SpeculativeStats()

    def run(self, requests: Seq[Request]) -> list[Result]:
        """Serve ``requests`` (indices ``0..n-1``); one Result each, in order.

        Raises:
            TypeError, ValueError: as chapter 09's engine (:func:`~parallel_lib.inference.batch.check_requests`).
        """
        requests = check_requests(requests, self.target.config.n_positions)
        most = max((r.slots for r in requests), default=1) + self.k
        engine = ServingEngine(self.target, self.max_batch * blocks_for(most, self.block_size), self.block_size,
                               self.max_batch, draft=self.draft, k=self.k)
        results = engine.run(requests)
        self.stats.add(engine.drafter.stats)
        return results
