"""The serving engine: a paged KV cache, a block manager and a continuous-batching scheduler around the one GPT-2.

Each :meth:`ServingEngine.step` is one forward pass of the one GPT-2 (:mod:`parallel_lib.models`)::

    scheduler.schedule()            which sequences run, each feeding tokens[computed:]
    one flattened row (1, s)        prefills (whole prompts) and decodes (one token) side by side, no padding
    the one GPT-2's blocks, cache=PagedStep   attention writes and reads the pool through block tables
    sample each row's last logits   chapter 09's sample(): greedy or the request's own seeded stream
    finished ones free their blocks

The batch is *flattened*, as vLLM lays it out: the new tokens of every sequence one after another in
one row, with no padding, and a mask letting each query see only its own sequence's keys up to its
position (the keys being each sequence's slots gathered in turn). A step that prefills a 40-token
prompt beside seven decodes computes 47 tokens, not eight rows padded to 40.

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
from dataclasses import dataclass
from typing import Any, Optional, Sequence as Seq

import torch
import torch.nn.functional as F

from parallel_lib.common.checks import check_number, positive_int
from parallel_lib.inference.batch import Request, Result, check_requests, sample
from parallel_lib.inference.engine import admit
from parallel_lib.models.hf import as_gpt2
from parallel_lib.serving.block_manager import BlockManager, blocks_for
from parallel_lib.serving.paged_kv_cache import PagedKVCache, slots_of
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


class ServingEngine:
    """Paged, continuously batched serving of one GPT-2 in this process; see the module docstring.

    Args:
        model: the one GPT-2 or a Hugging Face ``GPT2LMHeadModel`` (converted once; run in eval mode).
        num_blocks: blocks in the KV pool.
        block_size: token slots per block.
        max_batch: sequences in one step at most.
        prefix_caching: share full prompt blocks between requests (:mod:`.prefix_cache`).
        device: where the pool lives (the model's device by default).

    Raises:
        ValueError: a count below 1.
    """

    def __init__(self, model: Any, num_blocks: int, block_size: int = 16, max_batch: int = 8,
                 prefix_caching: bool = False, device: Optional[torch.device] = None) -> None:
        self.model = as_gpt2(model).eval()
        config = self.model.config
        param = next(self.model.parameters())
        self.device = param.device if device is None else torch.device(device)
        self.n_positions, self.vocab_size = config.n_positions, config.vocab_size
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching)
        self.cache = PagedKVCache(range(config.n_layer), num_blocks, block_size, config.n_head,
                                  config.n_embd // config.n_head, param.dtype, self.device)
        self.scheduler = Scheduler(self.blocks, positive_int("max_batch", max_batch))
        self.block_size = block_size
        self.records: list[StepRecord] = []
        self.results: dict[int, Result] = {}
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

    def _inputs(self, plan: Scheduled) -> tuple[torch.Tensor, ...]:
        """One step's batch, flattened: every sequence's new tokens side by side in one row, no padding.

        Returns ids (1, s), positions (1, s), write slots (1, s), valid (1, s), read slots (1, T) (every
        sequence's tokens, one sequence after another), allowed (1, 1, s, T) (a query sees the keys of its
        own sequence up to its position) and the index of each sequence's last new token (b,).
        """
        bs = self.block_size
        ids, positions, write, read, owner_q, owner_k, key_pos, last = [], [], [], [], [], [], [], []
        for row, (seq, start) in enumerate(zip(plan.sequences, plan.starts)):
            tokens, table = seq.tokens, self.blocks.tables[seq.id]
            n = len(tokens)
            ids += tokens[start:]
            positions += range(start, n)
            write += slots_of(table, start, n, bs)
            read += slots_of(table, 0, n, bs)
            owner_q += [row] * (n - start)
            owner_k += [row] * n
            key_pos += range(n)
            last.append(len(ids) - 1)
        as_long = lambda x: torch.tensor(x, dtype=torch.long)[None]  # noqa: E731  (1, len)
        ids_t, pos_t, write_t, read_t = as_long(ids), as_long(positions), as_long(write), as_long(read)
        oq, ok, kp = as_long(owner_q)[0], as_long(owner_k)[0], as_long(key_pos)[0]
        allowed = (oq[:, None] == ok[None, :]) & (kp[None, :] <= pos_t[0][:, None])         # (s, T)
        valid = torch.ones_like(ids_t, dtype=torch.bool)
        return tuple(t.to(self.device) for t in (ids_t, pos_t, write_t, valid, read_t, allowed[None, None],
                                                 torch.tensor(last)))

    @torch.no_grad()
    def step(self) -> Optional[StepRecord]:
        """Schedule, run one forward pass, sample, finish; returns the step's record (None when idle)."""
        start = self.now()
        plan = self.scheduler.schedule()
        if not plan.sequences:
            if self.scheduler.waiting:
                raise RuntimeError("no sequence could be scheduled while requests wait: the pool is too small")
            return None
        ids, positions, write, valid, read, allowed, last = self._inputs(plan)
        store = self.cache.at(write, valid, read)
        body = self.model.transformer
        # the flattened row may be longer than n_positions (many prompts side by side): every position in it
        # is a real one (below n_positions, checked when added), so look them up without the table's length check
        x = body.wte(ids) + F.embedding(positions, body.wpe.weight)                    # (1, s, h)
        for block in body.h:
            x = block(x, allowed, store)
        logits = self.model.lm_head(body.ln_f(x[0, last])).float().cpu()               # (b, V)
        now = self.now()
        prefill = [s.id for s, c in zip(plan.sequences, plan.starts) if s.id in plan.admitted or len(s.tokens) - c > 1]
        decode = [s.id for s in plan.sequences if s.id not in prefill]
        tables = {s.id: self.blocks.table(s.id) for s in plan.sequences}
        finished = []
        for row, seq in enumerate(plan.sequences):
            tokens = seq.tokens
            seq.computed = len(tokens)
            self.blocks.computed(seq.id, tokens, seq.computed)
            result = seq.result
            try:
                token = sample(logits[row], seq.request.temperature, seq.generator)
            except ValueError as error:
                result.error = f"request {seq.id} failed at token {len(result.tokens)}: {error}"
            else:
                result.tokens.append(token)
                result.token_times.append(now)
            if seq.finished():
                self.scheduler.finish(seq)
                finished.append(seq.id)
        record = StepRecord(len(self.records), prefill, decode, plan.admitted, plan.preempted, finished, tables,
                            {s.id: s.computed for s in plan.sequences}, self.blocks.num_free(), start, now)
        self.records.append(record)
        return record

    @property
    def preemptions(self) -> int:
        """Sequences preempted so far (each counted once per preemption)."""
        return sum(len(r.preempted) for r in self.records)
