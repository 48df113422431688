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

**Speculative decoding** (:mod:`.speculative`): given a draft model and ``k``, every sequence that
samples in a step first gets up to ``k`` guesses from the draft (:class:`~.speculative.Drafter`),
and the step's one pass feeds it its new tokens and the guesses, beside prefills and chunks; its
last ``guesses + 1`` logits accept a prefix of the guesses and add the target's own next token.
The guesses are not counted in ``max_step_tokens``. A record says how many each request proposed
and had accepted (``proposed``, ``accepted``).

Requests, results and sampling are chapter 09's (:mod:`parallel_lib.inference.batch`), so a request
gets the same tokens here as from :class:`parallel_lib.inference.Engine`, and, greedy, as from
Hugging Face's ``generate``. A request whose prompt holds a token outside the vocabulary gets its
error in its result (chapter 09's :func:`~parallel_lib.inference.engine.admit`); one that could never
fit the pool, or the model's context, is refused with a ValueError when it is added.

A long-running engine (behind :mod:`.http`) keeps only its last ``keep_records`` records; counts such
as :attr:`ServingEngine.preemptions` and :attr:`ServingEngine.steps` cover every step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from itertools import accumulate
from typing import Any, Callable, Optional, Sequence as Seq

import torch

from parallel_lib.common.checks import check_int, check_number, positive_int
from parallel_lib.inference.batch import Request, Result, check_requests, sample
from parallel_lib.inference.engine import admit
from parallel_lib.models.hf import as_gpt2
from parallel_lib.serving.block_manager import BlockManager, blocks_for
from parallel_lib.serving.layout import StepLayout, flat_is_cheaper, paged_forward, step_layout
from parallel_lib.serving.paged_kv_cache import PagedKVCache
from parallel_lib.serving.scheduler import Scheduled, Scheduler, Sequence
from parallel_lib.serving.speculative import Drafter, SpeculativeSequence

__all__ = ["StepRecord", "ServingEngine", "run_to_completion"]


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
        fed: tokens each request fed (its whole prompt, a chunk of it, or 1 for a decode), guesses not counted.
        proposed, accepted: with a draft, the guesses each request that sampled made and had accepted.
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
    proposed: dict[int, int] = field(default_factory=dict)
    accepted: dict[int, int] = field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float:
        """Guesses accepted / proposed in this step (NaN when none was proposed)."""
        proposed = sum(self.proposed.values())
        return sum(self.accepted.values()) / proposed if proposed else float("nan")



def run_to_completion(server: Any, requests: Seq[Request], n_positions: int) -> list[Result]:
    """Add ``requests`` to ``server`` (an engine, or a router of engines: ``add``, ``idle``, ``step``,
    ``results``) and step it until all are done; their results in order.

    Raises:
        TypeError, ValueError: a request :func:`~parallel_lib.inference.batch.check_requests` refuses
            (every request is checked before any is added).
    """
    requests = check_requests(requests, n_positions)
    first = len(server.results)
    for request in requests:
        server.add(request)
    while not server.idle():
        server.step()
    return [server.results[first + i] for i in range(len(requests))]


class ServingEngine:
    """Paged, continuously batched serving of one GPT-2 in this process; see the module docstring.

    Args:
        model: the one GPT-2 or a Hugging Face ``GPT2LMHeadModel`` (converted once; run in eval mode).
        num_blocks: blocks in the KV pool.
        block_size: token slots per block.
        max_batch: sequences in one step at most.
        prefix_caching: share full prompt blocks between requests (:mod:`.prefix_cache`).
        max_step_tokens: tokens one step feeds at most: chunked prefill (:mod:`.scheduler`); None: no limit.
        draft: a draft model (the one GPT-2 or Hugging Face's, same vocabulary and device) to speculate with;
            None: no speculation.
        k: with a draft, guesses per sequence and step at most.
        keep_records: keep only the last this many step records (a long-running server); None: all.

    The pool and every step's inputs live on the model's device, in its dtype.

    Attributes:
        drafter: the :class:`~.speculative.Drafter` with its statistics (``drafter.stats``), or None.

    Raises:
        ValueError: a count below 1, ``max_step_tokens`` below ``max_batch``, ``k`` below 0, or a draft
            whose vocabulary or device is not the model's.
    """

    def __init__(self, model: Any, num_blocks: int, block_size: int = 16, max_batch: int = 8,
                 prefix_caching: bool = False, max_step_tokens: Optional[int] = None, draft: Any = None,
                 k: int = 4, keep_records: Optional[int] = None) -> None:
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
        self.drafter = None if draft is None else Drafter(draft, self.blocks, self.vocab_size, self.device, k)
        self.records: list[StepRecord] = []
        self.keep_records = keep_records
        self.steps = 0          # steps run so far (records may keep fewer)
        self.preemptions = 0    # sequences preempted so far (each counted once per preemption)
        self.results: dict[int, Result] = {}
        # called with each sequence as it finishes, before its blocks are freed (a prefill rank ships them from here)
        self.on_finish: Optional[Callable[[Sequence], None]] = None
        self._t0 = time.perf_counter()

    @property
    def keep_records(self) -> Optional[int]:
        """Step records kept at most (the newest); None: every one."""
        return self._keep_records

    @keep_records.setter
    def keep_records(self, value: Optional[int]) -> None:
        self._keep_records = None if value is None else check_int(
            "keep_records", value, minimum=1, hint="None keeps every record")
        if self._keep_records is not None and len(self.records) > self._keep_records:
            del self.records[:len(self.records) - self._keep_records]

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
        self.scheduler.add(self._sequence(index, request, result, 0, torch.Generator().manual_seed(request.seed)))
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
        if not self.scheduler.adopt(self._sequence(index, request, result, len(request.prompt), generator)):
            return None
        self.results[index] = result
        return self.blocks.table(index)

    def _sequence(self, index: int, request: Request, result: Result, computed: int,
                  generator: torch.Generator) -> Sequence:
        """The scheduler's sequence of a request; with a draft, one that tracks the draft's pool too (which holds
        none of its tokens yet: an adopted prompt's keys came for the target only, the draft computes its own)."""
        kind = Sequence if self.drafter is None else SpeculativeSequence
        return kind(index, request, result, computed, generator=generator)

    def idle(self) -> bool:
        """Nothing waiting or running."""
        return self.scheduler.idle()

    def run(self, requests: Seq[Request]) -> list[Result]:
        """Add ``requests`` (indices ``0..n-1`` after any added before) and step until all are done.

        Raises:
            TypeError, ValueError: as :meth:`add` (checked for every request before any runs).
        """
        return run_to_completion(self, requests, self.n_positions)

    def flatten(self, plan: Scheduled) -> bool:
        """Whether to lay this step out flat (one row) or padded (a row per sequence): whichever computes less
        (:func:`~.layout.flat_is_cheaper`). Decodes alone are cheaper padded; a prompt beside them, flat."""
        fed = [stop - start for start, stop in zip(plan.starts, plan.stops)]
        return flat_is_cheaper(fed, plan.stops, self.model.config.n_embd)

    def _inputs(self, plan: Scheduled, flat: bool, guesses: Seq[list[int]]) -> StepLayout:
        """One step's batch (:mod:`.layout`): flat, one row holding every sequence's new tokens and keys; or
        padded, a row per sequence. A query sees the keys of its own sequence up to its position. Each
        sequence's ``guesses`` follow its new tokens."""
        seqs = plan.sequences
        tokens = [seq.tokens[start:stop] + g for seq, start, stop, g in zip(seqs, plan.starts, plan.stops, guesses)]
        stops = [stop + len(g) for stop, g in zip(plan.stops, guesses)]
        return step_layout([self.blocks.tables[seq.id] for seq in seqs], tokens, plan.starts, stops, self.block_size,
                           flat, self.device)

    @torch.no_grad()
    def step(self) -> Optional[StepRecord]:
        """Schedule, run one forward pass, sample, finish; returns the step's record (None when idle)."""
        start = self.now()
        plan = self.scheduler.schedule()
        if not plan.sequences:
            if self.scheduler.waiting:
                raise RuntimeError("no sequence could be scheduled while requests wait: the pool is too small")
            return None
        drafter = self.drafter
        guesses = [[] for _ in plan.sequences] if drafter is None else drafter.propose(plan)
        # the guesses lengthen each sequence's feed (no copy of the plan without a draft: every step runs this)
        flat = self.flatten(plan if drafter is None else
                            replace(plan, stops=[stop + len(g) for stop, g in zip(plan.stops, guesses)]))
        layout = self._inputs(plan, flat, guesses)
        x = paged_forward(self.model, self.cache.at(layout.write, layout.valid, layout.read), layout)  # (R, S, h)
        rows, cols = layout.rows, layout.cols
        if any(guesses):  # each sequence's last 1 + guesses positions: the logits that check its guesses
            width = torch.tensor([1 + len(g) for g in guesses], device=rows.device)
            back = torch.arange(int(width.sum()), device=rows.device) - (width.cumsum(0) - 1).repeat_interleave(width)
            rows, cols = rows.repeat_interleave(width), cols.repeat_interleave(width) + back
        logits = self.model.lm_head(x[rows, cols]).float().cpu()                        # (b + guesses, V)
        now = self.now()
        prefill = [s.id for s, a, b in zip(plan.sequences, plan.starts, plan.stops)
                   if s.id in plan.admitted or b - a > 1 or b < len(s.tokens)]
        decode = [s.id for s in plan.sequences if s.id not in prefill]
        fed = {s.id: b - a for s, a, b in zip(plan.sequences, plan.starts, plan.stops)}
        tables: dict[int, list[int]] = {}
        proposed: dict[int, int] = {}
        accepted: dict[int, int] = {}
        finished = []
        # greedy rows take the batch's argmax, found in one call (sample() row by row costs ~50 us a row on a
        # CPU, a tenth of a small model's decode step); a row with non-finite logits goes to sample() for its error
        argmax, finite = logits.argmax(-1).tolist(), torch.isfinite(logits).all(-1).tolist()
        for seq, stop, g, last in zip(plan.sequences, plan.stops, guesses, accumulate(1 + len(g) for g in guesses)):
            last -= 1  # the row of its last logits
            result, chunk = seq.result, stop < len(seq.tokens)
            if chunk:
                seq.computed = stop  # a chunk of a prompt: nothing to sample yet
            elif drafter is not None:
                proposed[seq.id] = len(g)
                if result.error is None:  # (a draft that failed ended the request)
                    accepted[seq.id] = drafter.accept(seq, logits[last - len(g):last + 1], now)
            else:
                seq.computed = stop
                try:
                    greedy = seq.request.temperature == 0.0 and finite[last]
                    token = argmax[last] if greedy else sample(logits[last], seq.request.temperature, seq.generator)
                except ValueError as error:
                    result.error = f"request {seq.id} failed at token {len(result.tokens)}: {error}"
                else:
                    result.tokens.append(token)
                    result.token_times.append(now)
            tokens = seq.tokens
            self.blocks.computed(seq.id, tokens, seq.computed if drafter is None else drafter.valid(seq))
            if drafter is not None and not chunk:
                self.blocks.truncate(seq.id, seq.computed)  # blocks for its accepted length: the lookahead goes back
            tables[seq.id] = self.blocks.table(seq.id)
            if not chunk and seq.finished():
                if self.on_finish is not None:
                    self.on_finish(seq)
                self.scheduler.finish(seq)
                finished.append(seq.id)
        record = StepRecord(self.steps, prefill, decode, plan.admitted, plan.preempted, finished, tables,
                            {s.id: s.computed for s in plan.sequences}, self.blocks.num_free(), start, now, flat, fed,
                            proposed, accepted)
        self.steps += 1
        self.preemptions += len(plan.preempted)
        self.records.append(record)
        if self.keep_records is not None and len(self.records) > self.keep_records:
            del self.records[0]
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
