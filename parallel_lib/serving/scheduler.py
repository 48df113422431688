"""Continuous (iteration-level) batching: the batch is decided again before every forward pass.

Chapter 09 serves a group of requests from its prefill to its longest request's last token: a
request that finishes early leaves its row idle, and a request that arrives waits for the whole
group. Orca (Yu et al. 2022, "Orca: A Distributed Serving System for Transformer-Based Generative
Models") schedules at the granularity of one iteration instead, and vLLM does it over a paged cache.
Before each step the :class:`Scheduler`

1. **grows the running sequences**: each feeds its newest token and may need one more block. When
   none is free it **preempts** the most recently admitted running sequence (vLLM's choice: the
   oldest requests keep their progress): its blocks go back to the pool and it returns to the head
   of the queue with the tokens it has, to be **recomputed** (prefilled again, prompt and generated
   tokens together) when blocks allow. A sequence that must preempt itself waits in the queue too.
2. **admits waiting sequences**, first come first served, while the batch has room (``max_batch``)
   and the pool has the blocks for all of their tokens (the queue's head blocks the rest: no request
   overtakes an older one). Nothing is admitted on a step that preempted (the pool is short).
3. returns the batch: every running sequence with the tokens it feeds, a whole prompt (prefill) and
   single tokens (decodes) side by side in one forward pass.

**Chunked prefill** (Agrawal et al. 2024, "Taming Throughput-Latency Tradeoff in LLM Inference with
Sarathi-Serve"; vLLM's ``max_num_batched_tokens``). With ``max_step_tokens`` set, a step feeds at most
that many tokens: every decode its one token first, then prompts, oldest first, as much as is left; a
long prompt is fed in chunks over several steps, beside the decodes, instead of stalling them for one
long step. A chunk that does not reach the prompt's end samples nothing.

The engine (:mod:`.engine`) runs the pass and reports back each sequence's new token; a finished
sequence frees its blocks at once, so the next step can admit a waiting one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import torch

from parallel_lib.common.checks import check_int, positive_int
from parallel_lib.inference.batch import Request, Result
from parallel_lib.serving.block_manager import BlockManager

__all__ = ["Sequence", "Scheduled", "Scheduler"]


@dataclass(eq=False)  # identity: two sequences are never "equal"
class Sequence:
    """One request inside the engine: its tokens so far and how many of them have keys and values in the pool.

    Attributes:
        id: the request's index (names its result, lanes and records).
        request: what was asked.
        result: what it got so far (``result.tokens`` are the generated tokens).
        computed: leading tokens whose keys and values are in the pool (0 when waiting).
        order: when it was last admitted (the preemption victim is the largest).
        preemptions: how many times it was preempted.
        generator: its own random stream, seeded by the request (chapter 09's rule: its sampled tokens
            depend on nothing else, not even on being preempted and recomputed).
    """

    id: int
    request: Request
    result: Result
    computed: int = 0
    order: int = -1
    preemptions: int = 0
    generator: torch.Generator = field(default_factory=torch.Generator)

    @property
    def tokens(self) -> list[int]:
        """Prompt and generated tokens."""
        return list(self.request.prompt) + self.result.tokens

    def finished(self) -> bool:
        """Failed, at ``max_new_tokens``, or just generated its ``eos``."""
        r, out = self.request, self.result.tokens
        return (self.result.error is not None or len(out) >= r.max_new_tokens
                or (r.eos is not None and bool(out) and out[-1] == r.eos))


@dataclass
class Scheduled:
    """What one step runs: the sequences with the tokens each feeds (``tokens[start:stop]``), and what changed.

    A sequence samples its next token when ``stop`` reaches its length; a chunk of a prompt that stops
    short of it only stores its keys and values.
    """

    sequences: list[Sequence]
    starts: list[int]
    stops: list[int]
    admitted: list[int]
    preempted: list[int]


class Scheduler:
    """Waiting queue, running batch, admission and preemption over one :class:`BlockManager`.

    Args:
        blocks: the block manager of the pool.
        max_batch: sequences in one step at most.
        max_step_tokens: tokens one step feeds at most (chunked prefill); None: no limit, every prompt
            whole. At least ``max_batch``, so that every decode always fits.

    Raises:
        ValueError: ``max_batch`` below 1, or ``max_step_tokens`` below ``max_batch``.
    """

    def __init__(self, blocks: BlockManager, max_batch: int, max_step_tokens: Optional[int] = None) -> None:
        self.blocks = blocks
        self.max_batch = positive_int("max_batch", max_batch)
        self.max_step_tokens = None
        if max_step_tokens is not None:
            self.max_step_tokens = check_int("max_step_tokens", max_step_tokens, minimum=max_batch,
                                             hint="every running sequence's decode must fit one step")
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._admissions = 0

    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` (at the back)."""
        self.waiting.append(seq)

    def idle(self) -> bool:
        return not self.waiting and not self.running

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq.id)
        self.running.remove(seq)
        seq.computed, seq.preemptions = 0, seq.preemptions + 1
        self.waiting.appendleft(seq)

    def schedule(self) -> Scheduled:
        """Decide this step's batch (see the module docstring)."""
        preempted: list[int] = []
        for seq in sorted(self.running, key=lambda s: s.order):  # oldest first: they keep their blocks
            if seq not in self.running:
                continue  # preempted by an older one in this loop
            length = len(seq.tokens)
            while not self.blocks.can_append(seq.id, length):
                victim = max(self.running, key=lambda s: s.order)
                self._preempt(victim)
                preempted.append(victim.id)
                if victim is seq:
                    break
            if seq in self.running:
                self.blocks.append(seq.id, length)
        # the step's token budget: every decode feeds its one token, then prefills (oldest first) what is left
        budget = self.max_step_tokens if self.max_step_tokens is not None else float("inf")
        feed: dict[int, int] = {}
        running = sorted(self.running, key=lambda s: s.order)
        for seq in running:
            if len(seq.tokens) - seq.computed == 1:
                feed[seq.id], budget = 1, budget - 1
        for seq in running:
            if seq.id not in feed:
                feed[seq.id] = int(min(len(seq.tokens) - seq.computed, budget))
                budget -= feed[seq.id]
        admitted: list[int] = []
        while not preempted and self.waiting and len(self.running) < self.max_batch and budget > 0:
            seq = self.waiting[0]
            if not self.blocks.can_allocate(seq.tokens):
                break
            self.waiting.popleft()
            seq.computed = self.blocks.allocate(seq.id, seq.tokens)
            seq.order, self._admissions = self._admissions, self._admissions + 1
            self.running.append(seq)
            admitted.append(seq.id)
            feed[seq.id] = int(min(len(seq.tokens) - seq.computed, budget))
            budget -= feed[seq.id]
        batch = [s for s in sorted(self.running, key=lambda s: s.order) if feed[s.id] > 0]
        return Scheduled(batch, [s.computed for s in batch], [s.computed + feed[s.id] for s in batch], admitted,
                         preempted)

    def adopt(self, seq: Sequence) -> bool:
        """Put ``seq`` straight into the batch: its first ``seq.computed`` tokens' keys and values were computed
        elsewhere (a prefill rank's, :mod:`.disaggregated`) and get blocks here now; its next step feeds the rest.

        Returns:
            False, changing nothing, while a sequence waits (none is overtaken), the batch is full or the blocks
            are short: try again after a step.
        """
        held = seq.tokens[:seq.computed]
        if self.waiting or len(self.running) >= self.max_batch or not self.blocks.can_allocate(held):
            return False
        self.blocks.allocate(seq.id, held)
        seq.order, self._admissions = self._admissions, self._admissions + 1
        self.running.append(seq)
        return True

    def finish(self, seq: Sequence) -> None:
        """``seq`` is done: free its blocks and drop it from the batch."""
        self.blocks.free(seq.id)
        self.running.remove(seq)

    def abort(self, seq_id: int) -> Optional[Sequence]:
        """Drop the sequence ``seq_id``, waiting or running (its blocks freed); returns it, None if not here."""
        for seq in self.waiting:
            if seq.id == seq_id:
                self.waiting.remove(seq)  # a waiting sequence holds no blocks (preemption freed them)
                return seq
        for seq in self.running:
            if seq.id == seq_id:
                self.finish(seq)
                return seq
        return None
