"""Prefill/decode disaggregation: prompts on prefill ranks, tokens on decode ranks, KV blocks sent between them.

A co-located engine (:class:`~parallel_lib.serving.engine.ServingEngine`) runs prefills and decodes
in the same forward passes. The two phases want different things: a prefill is a long pass that
computes many tokens at once (its cost is arithmetic; it sets the time to first token), a decode a
short pass per token for every running request (its cost is reading weights and keys; it sets the
time per output token). Side by side, each new prompt stalls every running decode for a step, and
the decodes delay the next prompt. DistServe (Zhong et al. 2024) and Splitwise (Patel et al. 2024)
put them on different GPUs; vLLM, SGLang and TensorRT-LLM serve that way with KV connectors moving
the cache between them. Here, on gloo ranks::

    prefill rank p                                   decode rank d
    requests arrive (the trace's clock)              KV blocks arrive (a receiver thread per prefill rank)
    ServingEngine, each request max_new_tokens=1     adopt: its own blocks, the prompt's keys and values
      one pass: the prompt, the first token            written there (block ids remapped)
    on finish: gather the blocks it used,            ServingEngine: continuous batching of decodes only
      post header, then blocks + generator    ──>      (a preempted request is recomputed here)
      state, and go on (waited at the end)

Request ``i`` goes to prefill rank ``i mod P`` and decode rank ``P + (i div P) mod D``; every rank
holds the whole trace, so each knows how many requests to expect from whom. The messages are
:mod:`.kv_transfer`'s (each exchange ONE ``batch_isend_irecv``, no tags, on the group of the two
ranks); every wait is bounded, and a failure names the rank (and reaches the caller through
:func:`~parallel_lib.runtime.launch` as a ``RankError``, the other ranks stopped).

The first token is sampled on the prefill rank (its TTFT never waits for decodes); later tokens on
the decode rank, with the request's own random stream carried over, so greedy and sampled requests
get the tokens one engine gives them. The decode rank receives on a thread, into a buffer, so that
a transfer never waits for its decode step; the buffer's blocks enter the pool when they fit
(what the decode rank has not yet taken sits in memory: a real engine bounds it, and its connector
reads straight into the pool).

:func:`run_disaggregated` serves a trace this way and returns every request's result on one clock
(the ranks start it together, after a barrier); :func:`compare_colocated` serves the same trace with
one co-located engine too, and sets TTFT, TPOT and goodput (:mod:`.goodput`) side by side. On one CPU
machine the ranks share its cores, so the split shows its effect on latency (no decode waits for a
prompt), not what it costs on real hardware (moving the cache between GPUs over a network). What the
split adds is the *hand-off*: between a request's first token (prefill rank) and its second (decode
rank) lie the transfer, two wake-ups of the receiver thread and the decode rank's next step boundary
(:attr:`Comparison.disaggregated_handoff`); on an idle machine a few milliseconds, on a loaded one,
where every wake-up waits for a core, it can dominate TPOT.
"""

from __future__ import annotations

import copy
import math
import queue
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from parallel_lib.common.checks import positive_int, positive_number
from parallel_lib.inference.batch import Request, Result
from parallel_lib.models.hf import as_gpt2
from parallel_lib.runtime import launch, rank_device
from parallel_lib.runtime.waiting import wait_for
from parallel_lib.serving.block_manager import blocks_for
from parallel_lib.serving.engine import ServingEngine
from parallel_lib.serving.goodput import Goodput, goodput
from parallel_lib.serving.kv_transfer import (CONTINUE, DONE, FAILED, HEADER_FIELDS, Header, Posted, gather_blocks,
                                              recv_request, scatter_blocks, send_request)
from parallel_lib.serving.scheduler import Sequence as Seq
from parallel_lib.serving.trace import Arrival, TraceMetrics, replay_continuous, trace_metrics

STARTUP_S = 60.0  # the longest any rank waits for the others to have built their engines (a loaded machine is slow)

__all__ = ["DisaggregatedJob", "RankRecord", "DisaggregatedRun", "disaggregated_job", "serve_rank", "gather_run",
           "run_disaggregated", "Comparison", "compare", "compare_colocated"]


@dataclass(frozen=True)
class DisaggregatedJob:
    """What every rank gets: the model, the trace, the ranks' roles and the engines' limits (see the module docstring).

    Build it with :func:`disaggregated_job`, which checks it.
    """

    model: Any
    trace: tuple[Arrival, ...]
    prefill_ranks: int
    decode_ranks: int
    num_blocks: int
    block_size: int
    max_batch: int
    timeout: float
    keep_kv: bool

    @property
    def world_size(self) -> int:
        return self.prefill_ranks + self.decode_ranks

    def prefill_of(self, i: int) -> int:
        """The prefill rank of request ``i``."""
        return i % self.prefill_ranks

    def decode_of(self, i: int) -> int:
        """The decode rank of request ``i``."""
        return self.prefill_ranks + (i // self.prefill_ranks) % self.decode_ranks

    def who(self, rank: int) -> str:
        return f"rank {rank} ({'prefill' if rank < self.prefill_ranks else 'decode'})"


def disaggregated_job(model: Any, trace: Sequence[Arrival], *, prefill_ranks: int = 1, decode_ranks: int = 1,
                      num_blocks: int = 64, block_size: int = 16, max_batch: int = 8, timeout: float = 60.0,
                      keep_kv: bool = False) -> DisaggregatedJob:
    """Check the arguments of :func:`run_disaggregated` and pack them for the ranks.

    Raises:
        TypeError: ``model`` is not a torch module, ``trace`` not a list of :class:`~.trace.Arrival`.
        ValueError: a count below 1, a timeout not > 0, an empty trace, or a request that does not fit one
            rank's pool (``num_blocks``) or the model's context.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be the one GPT-2 or a Hugging Face GPT2LMHeadModel, got {type(model).__name__}")
    if isinstance(trace, Arrival) or not isinstance(trace, (list, tuple)):
        raise TypeError(f"trace must be a list of Arrival (poisson_trace gives one), got {type(trace).__name__}")
    if not trace:
        raise ValueError("trace must hold at least one Arrival, got an empty trace")
    for i, arrival in enumerate(trace):
        if not isinstance(arrival, Arrival):
            raise TypeError(f"trace[{i}] must be an Arrival, got {type(arrival).__name__}")
    positive_int("prefill_ranks", prefill_ranks), positive_int("decode_ranks", decode_ranks)
    positive_int("num_blocks", num_blocks), positive_int("block_size", block_size)
    positive_int("max_batch", max_batch), positive_number("timeout", timeout)
    gpt2 = as_gpt2(model)
    if next(gpt2.parameters()).device.type != "cpu":  # the ranks get a CPU copy; the caller's model stays put
        gpt2 = copy.deepcopy(gpt2).cpu()
    n_positions = gpt2.config.n_positions
    for i, arrival in enumerate(trace):
        request = arrival.request
        if request.slots > n_positions:
            raise ValueError(f"trace[{i}]: a prompt of {len(request.prompt)} tokens plus max_new_tokens="
                             f"{request.max_new_tokens} needs more than the model's n_positions={n_positions}")
        need = blocks_for(request.slots, block_size)
        if need > num_blocks:
            raise ValueError(f"trace[{i}] needs {need} blocks of {block_size} for {request.slots} tokens, more than "
                             f"each rank's num_blocks={num_blocks}; build larger pools")
    return DisaggregatedJob(gpt2, tuple(trace), prefill_ranks, decode_ranks, num_blocks, block_size, max_batch,
                            float(timeout), bool(keep_kv))


@dataclass
class RankRecord:
    """What one rank did.

    Attributes:
        rank, role: the rank and "prefill" or "decode".
        results: the requests it served, on the run's clock (a prefill rank's hold the first token).
        tables: each request's prompt blocks in this rank's pool (ids differ between ranks).
        bytes: bytes sent (prefill) or received (decode), headers included.
        steps: forward passes.
        kv: with ``keep_kv``: the blocks a prefill rank sent / a decode rank's pool held there once written.
    """

    rank: int
    role: str
    results: dict[int, Result] = field(default_factory=dict)
    tables: dict[int, list[int]] = field(default_factory=dict)
    bytes: int = 0
    steps: int = 0
    kv: dict[int, torch.Tensor] = field(default_factory=dict)


def _engine(model: Any, job: DisaggregatedJob) -> ServingEngine:
    """A fresh engine, after a warm-up pass in a throwaway one (a process's first passes are slower)."""
    ServingEngine(model, num_blocks=1, block_size=job.block_size, max_batch=1).run([Request([0], 2)])
    return ServingEngine(model, job.num_blocks, job.block_size, job.max_batch)


def _prefill(rank: int, job: DisaggregatedJob, engine: ServingEngine, groups: dict, device: torch.device,
             offset: float, origin: float) -> RankRecord:
    """Serve this rank's requests' prompts as they arrive; ship each to its decode rank as it finishes."""
    record, who = RankRecord(rank, "prefill"), job.who(rank)
    outbox: list[Posted] = []  # sends in flight: this rank goes on with the next prompts meanwhile

    def ship(i: int, seq: Optional[Seq]) -> None:
        result, asked, d = engine.results[i], job.trace[i].request, job.decode_of(i)
        if seq is None or result.error is not None or not result.tokens:
            header, blocks, state = Header(i, FAILED, len(asked.prompt), -1, 0, 0, 0), None, None
        else:
            token, first_ns = result.tokens[0], round((result.token_times[0] - offset) * 1e9)
            if asked.max_new_tokens == 1 or token == asked.eos:
                header, blocks, state = Header(i, DONE, len(asked.prompt), token, first_ns, 0, 0), None, None
            else:
                table = engine.blocks.table(i)
                blocks, state = gather_blocks(engine.cache, table), seq.generator.get_state()
                header = Header(i, CONTINUE, len(asked.prompt), token, first_ns, len(table), state.numel())
                record.tables[i] = table
                if job.keep_kv:
                    record.kv[i] = blocks.cpu()
        posted = send_request(header, blocks, state, d, groups[rank, d], device, who)
        record.bytes += posted.bytes
        outbox.append(posted)

    engine.on_finish = lambda seq: ship(seq.id, seq)
    mine = [i for i in range(len(job.trace)) if job.prefill_of(i) == rank]
    nxt = 0
    while nxt < len(mine) or not engine.idle():
        if engine.idle():
            time.sleep(max(0.0, origin + job.trace[mine[nxt]].time - time.perf_counter()))
        while nxt < len(mine) and job.trace[mine[nxt]].time <= time.perf_counter() - origin:
            i = mine[nxt]
            nxt += 1
            asked = job.trace[i].request
            engine.add(replace(asked, max_new_tokens=1), i, job.trace[i].time + offset)
            if engine.results[i].error is not None:  # refused (a token outside the vocabulary): never scheduled
                ship(i, None)
        if engine.step() is not None:
            record.steps += 1
    for posted in outbox:
        posted.wait(job.timeout)
    for i in mine:
        record.results[i] = _on_run_clock(engine.results[i], offset)
    return record


def _on_run_clock(result: Result, offset: float) -> Result:
    result.arrival -= offset
    result.token_times = [t - offset for t in result.token_times]
    return result


def _receive(peer: int, count: int, inbox: queue.Queue, args: tuple) -> None:
    """A receiver thread: ``count`` requests from prefill rank ``peer``, each put in ``inbox`` (or the error)."""
    try:
        device = args[3]
        if device.type == "cuda":
            torch.cuda.set_device(device)  # a thread's current GPU is its own: the rank's, as in the main thread
        for _ in range(count):
            inbox.put(recv_request(peer, *args))
    except BaseException as error:  # noqa: BLE001 - handed to the decode loop, which raises it
        inbox.put(error)


def _decode(rank: int, job: DisaggregatedJob, engine: ServingEngine, groups: dict, device: torch.device,
            offset: float) -> RankRecord:
    """Take requests as their blocks arrive, when the pool and the batch have room; decode them continuously."""
    record, who = RankRecord(rank, "decode"), job.who(rank)
    cache = engine.cache
    block_shape = (len(cache.layers), 2, cache.block_size, cache.heads, cache.head_dim)
    dtype = cache.k[cache.layers[0]].dtype
    counts = {p: sum(1 for i in range(len(job.trace)) if job.prefill_of(i) == p and job.decode_of(i) == rank)
              for p in range(job.prefill_ranks)}
    inbox: queue.Queue = queue.Queue()
    limit = job.timeout + job.trace[-1].time  # a request may come as late as the trace's last arrival
    for p, count in counts.items():
        if count:
            args = (groups[p, rank], block_shape, dtype, device, limit, who)
            threading.Thread(target=_receive, args=(p, count, inbox, args), name=f"receive from rank {p}",
                             daemon=True).start()
    expected, got, pending = sum(counts.values()), 0, deque()
    while got < expected or pending or not engine.idle():
        wait = engine.idle() and not pending  # nothing to compute: wait for the next request
        try:
            while got < expected:
                item = inbox.get(timeout=limit + 5.0) if wait else inbox.get_nowait()
                wait, got = False, got + 1
                if isinstance(item, BaseException):
                    raise item  # the receiver's own error: it names this rank, the peer and what it waited for
                header, blocks, _ = item
                record.bytes += 8 * HEADER_FIELDS + (0 if blocks is None else
                                                     blocks.numel() * blocks.element_size() + header.state_bytes)
                if header.status == CONTINUE:
                    pending.append(item)
        except queue.Empty:
            if wait:
                raise TimeoutError(f"{who}: no request from the prefill rank(s) within {limit + 5:g} s; "
                                   f"{expected - got} of {expected} still to come") from None
        while pending:
            header, blocks, state = pending[0]
            i = header.index
            generator = torch.Generator()
            generator.set_state(state)
            table = engine.adopt(job.trace[i].request, i, job.trace[i].time + offset, header.first_token,
                                 header.first_ns / 1e9 + offset, generator)
            if table is None:
                if engine.idle():
                    raise RuntimeError(f"{who}: request {i} does not fit an empty pool of {job.num_blocks} blocks")
                break
            scatter_blocks(cache, table, blocks.to(cache.k[cache.layers[0]].device))
            record.tables[i] = table
            if job.keep_kv:
                record.kv[i] = gather_blocks(cache, table).cpu()
            pending.popleft()
        if engine.step() is not None:
            record.steps += 1
    for i, result in engine.results.items():
        record.results[i] = _on_run_clock(result, offset)
    return record


def serve_rank(rank: int, world_size: int, job: DisaggregatedJob) -> RankRecord:
    """One rank of a disaggregated run (``launch(serve_rank, job.world_size, job)``): prefill or decode.

    Raises:
        ValueError: ``world_size`` is not ``job.world_size``.
        TimeoutError, RuntimeError: a wait ran out or a peer failed, naming this rank.
    """
    if world_size != job.world_size:
        raise ValueError(f"world_size={world_size}, but the job has {job.prefill_ranks} prefill and "
                         f"{job.decode_ranks} decode ranks; launch {job.world_size} ranks")
    device = rank_device()
    model = job.model.to(device).eval()
    prefill, decode = range(job.prefill_ranks), range(job.prefill_ranks, world_size)
    groups = {(p, d): dist.new_group([p, d]) for p in prefill for d in decode}  # the same order on every rank
    engine = _engine(model, job)
    wait_for(dist.barrier(async_op=True), max(job.timeout, STARTUP_S), f"{job.who(rank)} waiting for every rank to "
             "start")
    origin = time.perf_counter()
    offset = engine.now() - (time.perf_counter() - origin)  # engine clock minus the run's clock
    with torch.no_grad():
        if rank in prefill:
            return _prefill(rank, job, engine, groups, device, offset, origin)
        return _decode(rank, job, engine, groups, device, offset)


@dataclass
class DisaggregatedRun:
    """A disaggregated run: every request's result in trace order (the run's clock), each rank's record."""

    job: DisaggregatedJob
    results: list[Result]
    ranks: list[RankRecord]
    seconds: float

    @property
    def bytes_sent(self) -> int:
        """Bytes the prefill ranks sent (headers, KV blocks, generator states)."""
        return sum(r.bytes for r in self.ranks if r.role == "prefill")


def gather_run(job: DisaggregatedJob, records: Sequence[RankRecord], seconds: float = math.nan) -> DisaggregatedRun:
    """The ranks' records as one run: a request's result from its decode rank, else (done or failed at the
    prefill) from its prefill rank.

    Raises:
        ValueError: a record per rank is missing, or a request has no result.
    """
    if len(records) != job.world_size:
        raise ValueError(f"records must hold one RankRecord per rank ({job.world_size}), got {len(records)}")
    results = []
    for i in range(len(job.trace)):
        p, d = job.prefill_of(i), job.decode_of(i)
        result = records[d].results.get(i) or records[p].results.get(i)
        if result is None:
            raise ValueError(f"request {i} has no result on rank {p} (prefill) or rank {d} (decode)")
        result.served_by = f"rank {p} (prefill)" + (f", rank {d} (decode)" if i in records[d].results else "")
        results.append(result)
    return DisaggregatedRun(job, results, list(records), seconds)


def run_disaggregated(model: Any, trace: Sequence[Arrival], *, prefill_ranks: int = 1, decode_ranks: int = 1,
                      num_blocks: int = 64, block_size: int = 16, max_batch: int = 8, timeout: float = 60.0,
                      keep_kv: bool = False, backend: str = "auto", threads_per_rank: int = 1) -> DisaggregatedRun:
    """Serve ``trace`` on ``prefill_ranks + decode_ranks`` launched ranks (see the module docstring).

    Args:
        model: the one GPT-2 or a Hugging Face ``GPT2LMHeadModel`` (every rank gets a copy).
        trace: arrivals (:func:`~parallel_lib.serving.trace.poisson_trace`), replayed in real time.
        prefill_ranks, decode_ranks: ranks of each role.
        num_blocks, block_size, max_batch: each rank's engine (:class:`~parallel_lib.serving.engine.ServingEngine`).
        timeout: seconds any wait may take; a decode rank's wait for its next request and the launch's limit
            add the trace's span (a request may arrive as late as the last arrival).
        keep_kv: keep the blocks each request's prompt had on both sides (:attr:`RankRecord.kv`).
        backend: the launch's ("auto": NCCL with a GPU per rank, else gloo).
        threads_per_rank: torch threads in each rank.

    Returns:
        the results in trace order on the run's clock (arrival 0 = the first request), each rank's record.

    Raises:
        TypeError, ValueError: as :func:`disaggregated_job`.
        RankError: a rank failed (naming it); LaunchTimeoutError: the run outlived its limit.
    """
    job = disaggregated_job(model, trace, prefill_ranks=prefill_ranks, decode_ranks=decode_ranks,
                            num_blocks=num_blocks, block_size=block_size, max_batch=max_batch, timeout=timeout,
                            keep_kv=keep_kv)
    start = time.perf_counter()
    records = launch(serve_rank, job.world_size, job, backend=backend, timeout=timeout + job.trace[-1].time,
                     threads_per_rank=threads_per_rank)
    return gather_run(job, records, time.perf_counter() - start)


@dataclass(frozen=True)
class Comparison:
    """One trace served co-located (one engine does both phases) and disaggregated, side by side.

    Attributes:
        colocated, disaggregated: throughput, TTFT, TPOT, latency of each.
        colocated_goodput, disaggregated_goodput: requests meeting the targets, per second.
        colocated_handoff, disaggregated_handoff: median seconds from the first token to the second (disaggregated:
            the first comes from the prefill rank, the second from the decode rank once the blocks arrived and it
            took the request); part of TPOT.
        same_tokens: every request got the same tokens both ways.
        bytes_sent: by the prefill ranks.
    """

    colocated: TraceMetrics
    disaggregated: TraceMetrics
    colocated_goodput: Goodput
    disaggregated_goodput: Goodput
    colocated_handoff: float
    disaggregated_handoff: float
    same_tokens: bool
    bytes_sent: int


def _handoff(results: Sequence[Result]) -> float:
    """Median seconds between the first and the second token (NaN when no request got two)."""
    gaps = [r.token_times[1] - r.token_times[0] for r in results if r.ok and len(r.token_times) > 1]
    return statistics.median(gaps) if gaps else math.nan


def compare(colocated: Sequence[Result], run: DisaggregatedRun, ttft_slo: float, tpot_slo: float) -> Comparison:
    """Set a co-located replay of ``run``'s trace beside ``run``: TTFT, TPOT, throughput, goodput, tokens.

    Args:
        colocated: :func:`~parallel_lib.serving.trace.replay_continuous` of the same trace (trace order).
        run: :func:`run_disaggregated` of it.
        ttft_slo, tpot_slo: the latency targets of goodput, seconds (:func:`~parallel_lib.serving.goodput.goodput`).

    Raises:
        ValueError: a target not > 0, or results of another trace (another count).
    """
    positive_number("ttft_slo", ttft_slo), positive_number("tpot_slo", tpot_slo)
    if len(colocated) != len(run.results):
        raise ValueError(f"colocated must hold a result per request of the run's trace ({len(run.results)}), "
                         f"got {len(colocated)}")
    same = [r.tokens for r in colocated] == [r.tokens for r in run.results]
    return Comparison(trace_metrics(colocated), trace_metrics(run.results), goodput(colocated, ttft_slo, tpot_slo),
                      goodput(run.results, ttft_slo, tpot_slo), _handoff(colocated), _handoff(run.results), same,
                      run.bytes_sent)


def compare_colocated(model: Any, trace: Sequence[Arrival], ttft_slo: float, tpot_slo: float, *,
                      num_blocks: int = 64, block_size: int = 16, max_batch: int = 8, timeout: float = 60.0,
                      prefill_ranks: int = 1, decode_ranks: int = 1) -> Comparison:
    """Serve ``trace`` disaggregated, then with one co-located engine (in this process, one thread); :func:`compare`.

    Args:
        model, trace, num_blocks, block_size, max_batch, timeout, prefill_ranks, decode_ranks: as
            :func:`run_disaggregated` (the co-located engine gets ``num_blocks`` and ``max_batch`` too).
        ttft_slo, tpot_slo: the latency targets of goodput, seconds.

    Raises:
        TypeError, ValueError: as :func:`disaggregated_job`, or a target not > 0.
    """
    positive_number("ttft_slo", ttft_slo), positive_number("tpot_slo", tpot_slo)
    run = run_disaggregated(model, trace, prefill_ranks=prefill_ranks, decode_ranks=decode_ranks,
                            num_blocks=num_blocks, block_size=block_size, max_batch=max_batch, timeout=timeout)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs
    try:
        colocated = replay_continuous(_engine(run.job.model, run.job), trace)
    finally:
        torch.set_num_threads(threads)
    return compare(colocated, run, ttft_slo, tpot_slo)
