"""The serving engine: a paged KV cache, a block manager and a continuous-batching scheduler around the one GPT-2.

Each :meth:`ServingEngine.step` is one forward pass of the one GPT-2 (:mod:`parallel_lib.models`)::

    scheduler.schedule()            which sequences run, each feeding tokens[computed:stop]
    one batch, flat or padded       prefills (whole prompts) and decodes (one token) side by side
    the one GPT-2's blocks, cache=PagedStep   attention writes and reads the pool through block tables
    sample each row's last logits   chapter 09's sample(): greedy or the request's own seeded stream
    finished ones free their blocks

A step's batch is laid out one of two ways, whichever computes less (:meth:`ServingEngine.flatten`):
*flat*, as vLLM lays it out, the new tokens of every sequence one after another in one row, no padding,
with a mask letting each query see only its own sequence's keys up to its position (a step that
prefills a 40-token prompt beside seven decodes computes 47 token rows, not eight rows padded to 40);
or *padded*, a row per sequence (decodes alone: one token each, and no query scores another
sequence's keys). vLLM's attention kernel reads each sequence's blocks in place and needs neither;
here the model's own attention runs on gathered keys, so the layout is the engine's choice. Each
record says which (``flat``).

Each step appends a :class:`StepRecord`: which requests ran (prefill or decode), which were admitted,
preempted or finished, every running request's block table and length, and the free blocks. The
widget of the chapter replays these records; :mod:`.waste` measures memory from them.

Requests, results and sampling are chapter 09's (:mod:`parallel_lib.inference.batch`), so a request
gets the same tokens here as from :class:`parallel_lib.inference.Engine`, and, greedy, as from
Hugging Face's ``generate``. A request whose prompt holds a token outside the vocabulary gets its
error in its result (chapter 09's :func:`~parallel_lib.inference.engine.admit`); one that could never
fit the pool, or the model's context, is refused with a ValueError when it is added.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence as Seq

import torch

from parallel_lib.common.checks import check_number, positive_int
from parallel_lib.inference.batch import Request, Result, check_requests, sample
from parallel_lib.inference.engine import admit
from parallel_lib.models.hf import as_gpt2
from parallel_lib.serving.block_manager import BlockManager, blocks_for
from parallel_lib.serving.layout import StepLayout, paged_forward, step_layout
from parallel_lib.serving.paged_kv_cache import PagedKVCache
from parallel_lib.serving.scheduler import Scheduled, Scheduler, Sequence

__all__ = ["StepRecord", "ServingEngine"]


@dataclass
class StepRecord:
    """What one step did (request ids throughout); the scheduler's record, replayed by the widget.

    Attributes:
        step: its number from 0.
        prefill, decode: the requests that fed several tokens (a prompt, or a recomputed sequence) / one.
        admitted, preempted, finished: what changed in this step.
        tables: every request running in this step and its block table after the step's allocation.
        lengths: tokens each of them holds in the pool after the step (its computed tokens).
        free_blocks: blocks free (or evictable) after the step.
        start, end: seconds on the engine's clock.
        flat: the step ran flat (one row) rather than padded (a row per sequence).
        fed: tokens each request fed (its whole prompt, a chunk of it, or 1 for a decode).
    """

    step: int
    prefill: list[int]
    decode: list[int]
    admitted: list[int]
    preempted: list[int]
    finished: list[int]
    tables: dict[int, list[int]]
    lengths: dict[int, int]
    free_blocks: int
    start: float
    end: float
    flat: bool = False
    fed: dict[int, int] = field(default_factory=dict)


class ServingEngine:
    """Paged, continuously batched serving of one GPT-2 in this process; see the module docstring.

    Args:
        model: the one GPT-2 or a Hugging Face ``GPT2LMHeadModel`` (converted once; run in eval mode).
        num_blocks: blocks in the KV pool.
        block_size: token slots per block.
        max_batch: sequences in one step at most.
        prefix_caching: share full prompt blocks between requests (:mod:`.prefix_cache`).
        max_step_tokens: tokens one step feeds at most: chunked prefill (:mod:`.scheduler`); None: no limit.

    The pool and every step's inputs live on the model's device, in its dtype.

    Raises:
        ValueError: a count below 1, or ``max_step_tokens`` below ``max_batch``.
    """

    def __init__(self, model: Any, num_blocks: int, block_size: int = 16, max_batch: int = 8,
                 prefix_caching: bool = False, max_step_tokens: Optional[int] = None) -> None:
        self.model = as_gpt2(model).eval()
        config = self.model.config
        param = next(self.model.parameters())
        self.device = param.device
        self.n_positions, self.vocab_size = config.n_positions, config.vocab_size
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching)
        tp = getattr(getattr(self.model, "tp_info", None), "tp", 1)  # a tensor-parallel shard: n_head / tp heads
        self.cache = PagedKVCache(range(config.n_layer), num_blocks, block_size, config.n_head // tp,
                                  config.n_embd // config.n_head, param.dtype, self.device)
        self.scheduler = Scheduler(self.blocks, positive_int("max_batch", max_batch), max_step_tokens)
        self.block_size = block_size
        self.records: list[StepRecord] = []
        self.results: dict[int, Result] = {}
        # called with each sequence as it finishes, before its blocks are freed (a prefill rank ships them from here)
        self.on_finish: Optional[Callable[[Sequence], None]] = None
        self._t0 = time.perf_counter()

    def now(self) -> float:
        """Seconds since the engine was built (the clock of results and records)."""
        return time.perf_counter() - self._t0

    def add(self, request: Request, index: Optional[int] = None, arrival: Optional[float] = None) -> int:
        """Queue ``request``; returns its index (``index``, default the next free one).

        Args:
            request: a chapter 09 :class:`~parallel_lib.inference.batch.Request`.
            index: its index (names its result); must be new.
            arrival: its arrival time on the engine's clock (default: now).

        Raises:
            TypeError: ``request`` is not a Request.
            ValueError: ``index`` is taken, or the request needs more positions than the model has or more
                blocks than the pool holds.
        """
        check_requests([request], self.n_positions)
        index = len(self.results) if index is None else index
        if index in self.results:
            raise ValueError(f"index={index} is already a request of this engine; give each request its own index")
        need = blocks_for(request.slots, self.block_size)
        if need > self.blocks.num_blocks:
            raise ValueError(f"request {index} needs {need} blocks of {self.block_size} for {request.slots} tokens, "
                             f"more than the pool's num_blocks={self.blocks.num_blocks}; build a larger pool")
        arrival = self.now() if arrival is None else check_number("arrival", arrival)
        _, refused = admit([request], [index], self.vocab_size)
        if refused:
            refused[0].arrival = arrival
            self.results[index] = refused[0]
            return index
        result = Result(index, arrival=arrival, served_by=str(self.device))
        self.results[index] = result
        self.scheduler.add(Sequence(index, request, result, generator=torch.Generator().manual_seed(request.seed)))
        return index

    def adopt(self, request: Request, index: int, arrival: float, token: int, token_time: float,
              generator: torch.Generator) -> Optional[list[int]]:
        """Continue request ``index``, whose prompt another engine prefilled and whose first token it sampled.

        Prefill/decode disaggregation (:mod:`.disaggregated`): the sequence joins the batch with blocks for its
        prompt, whose keys and values the caller writes there (:func:`.kv_transfer.scatter_blocks`) before the
        next step; that step feeds its first token.

        Args:
            request: what was asked (checked as :meth:`add` checks it).
            index: its index (names its result); must be new.
            arrival: its arrival, on this engine's clock.
            token, token_time: the first token and when it came (this engine's clock).
            generator: its random stream after the first token was drawn.

        Returns:
            its block table here; None, changing nothing, when the batch or the pool has no room now.

        Raises:
            TypeError, ValueError: as :meth:`add`.
        """
        check_requests([request], self.n_positions)
        if index in self.results:
            raise ValueError(f"index={index} is already a request of this engine; give each request its own index")
        result = Result(index, [token], arrival=arrival, token_times=[token_time], served_by=str(self.device))
        if not self.scheduler.adopt(Sequence(index, request, result, len(request.prompt), generator=generator)):
            return None
        self.results[index] = result
        return self.blocks.table(index)

    def idle(self) -> bool:
        """Nothing waiting or running."""
        return self.scheduler.idle()

    def run(self, requests: Seq[Request]) -> list[Result]:
        """Add ``requests`` (indices ``0..n-1`` after any added before) and step until all are done.

        Raises:
            TypeError, ValueError: as :meth:`add` (checked for every request before any runs).
        """
        requests = check_requests(requests, self.n_positions)
        first = len(self.results)
        for request in requests:
            self.add(request)
        while not self.idle():
            self.step()
        return [self.results[first + i] for i in range(len(requests))]

    def flatten(self, plan: Scheduled) -> bool:
        """Whether to lay this step out flat (one row) or padded (a row per sequence): whichever computes less.

        Per layer and token row the projections and the MLP cost about ``12 h`` multiply-adds per feature,
        and each attention score about 2: flat computes ``sum(fed)`` rows and ``sum(fed) · sum(len)``
        scores (every query against every sequence's keys, most masked), padded ``b · max(fed)`` rows and
        ``b · max(fed) · max(len)`` scores. Decodes alone are cheaper padded; a prompt beside them, flat.
        """
        fed = [stop - start for start, stop in zip(plan.starts, plan.stops)]
        lengths = plan.stops
        h = self.model.config.n_embd
        flat = sum(fed) * 12 * h + 2 * sum(fed) * sum(lengths)
        padded = len(fed) * max(fed) * 12 * h + 2 * len(fed) * max(fed) * max(lengths)
        return flat < padded

    def _inputs(self, plan: Scheduled, flat: bool) -> StepLayout:
        """One step's batch (:mod:`.layout`): flat, one row holding every sequence's new tokens and keys; or
        padded, a row per sequence. A query sees the keys of its own sequence up to its position."""
        seqs = plan.sequences
        tokens = [seq.tokens[start:stop] for seq, start, stop in zip(seqs, plan.starts, plan.stops)]
        return step_layout([self.blocks.tables[seq.id] for seq in seqs], tokens, plan.starts, plan.stops,
                           self.block_size, flat, self.device)

    @torch.no_grad()
    def step(self) -> Optional[StepRecord]:
        """Schedule, run one forward pass, sample, finish; returns the step's record (None when idle)."""
        start = self.now()
        plan = self.scheduler.schedule()
        if not plan.sequences:
            if self.scheduler.waiting:
                raise RuntimeError("no sequence could be scheduled while requests wait: the pool is too small")
            return None
        flat = self.flatten(plan)
        layout = self._inputs(plan, flat)
        x = paged_forward(self.model, self.cache.at(layout.write, layout.valid, layout.read), layout)  # (R, S, h)
        logits = self.model.lm_head(x[layout.rows, layout.cols]).float().cpu()          # (b, V)
        now = self.now()
        prefill = [s.id for s, a, b in zip(plan.sequences, plan.starts, plan.stops)
                   if s.id in plan.admitted or b - a > 1 or b < len(s.tokens)]
        decode = [s.id for s in plan.sequences if s.id not in prefill]
        tables = {s.id: self.blocks.table(s.id) for s in plan.sequences}
        fed = {s.id: b - a for s, a, b in zip(plan.sequences, plan.starts, plan.stops)}
        finished = []
        # greedy rows take the batch's argmax, found in one call (sample() row by row costs ~50 us a row on a
        # CPU, a tenth of a small model's decode step); a row with non-finite logits goes to sample() for its error
        argmax, finite = logits.argmax(-1).tolist(), torch.isfinite(logits).all(-1).tolist()
        for row, (seq, stop) in enumerate(zip(plan.sequences, plan.stops)):
            tokens = seq.tokens
            seq.computed = stop
            self.blocks.computed(seq.id, tokens, stop)
            if stop < len(tokens):
                continue  # a chunk of a prompt: nothing to sample yet
            result = seq.result
            try:
                greedy = seq.request.temperature == 0.0 and finite[row]
                token = argmax[row] if greedy else sample(logits[row], seq.request.temperature, seq.generator)
            except ValueError as error:
                result.error = f"request {seq.id} failed at token {len(result.tokens)}: {error}"
            else:
                result.tokens.append(token)
                result.token_times.append(now)
            if seq.finished():
                if self.on_finish is not None:
                    self.on_finish(seq)
                self.scheduler.finish(seq)
                finished.append(seq.id)
        record = StepRecord(len(self.records), prefill, decode, plan.admitted, plan.preempted, finished, tables,
                            {s.id: s.computed for s in plan.sequences}, self.blocks.num_free(), start, now, flat, fed)
        self.records.append(record)
        return record

    def abort(self, index: int, reason: str = "aborted") -> bool:
        """Stop request ``index`` between steps (its client left): its blocks are freed, its result gets ``reason``.

        Returns:
            whether it was still waiting or running (False: finished, or never added).
        """
        seq = self.scheduler.abort(index)
        if seq is None:
            return False
        seq.result.error = f"request {index}: {reason}"
        return True

    @property
    def preemptions(self) -> int:
        """Sequences preempted so far (each counted once per preemption)."""
        return sum(len(r.preempted) for r in self.records)
