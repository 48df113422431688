"""Pipeline-parallel generation: stages on ranks, several request groups in flight.

Decoding is one token at a time, and token ``t + 1`` of a request needs token ``t`` from the
last stage: with one group of requests, stage 0 waits while the others work, exactly the
bubble of chapter 04 with one micro-batch. With ``m`` groups the stages take turns, like
micro-batches: while stage 1 runs group 0's step, stage 0 runs group 1's, and the last
stage's tokens for group 0 come back to stage 0 in time for its next step once ``m``
reaches the number of stages. Throughput rises with the groups in flight; one request's
latency does not fall (it still crosses every stage once per token).

**The schedule is data** (:func:`generation_schedule`): the list of ``(step, group)``
items every stage runs in the same order, round by round, a group's rounds ending with
its longest request. Every rank computes it from the requests, so shapes and counts agree
without a word. A request that stopped early (end-of-sequence) keeps its row until its
group is done, and only the last stage knows it stopped.

**Messages.** Stage ``s`` sends each item's hidden state (b, s, n_embd) to stage ``s + 1``;
the last stage sends the sampled tokens (b,) back to stage 0. Each goes out through
``dist.batch_isend_irecv`` with no tags: messages between two ranks match in the order they
were posted, per direction, and every rank posts them in the schedule's order. Receives are
waited for when the item needs them; sends are waited for only at the end, so no stage
blocks on a neighbour that is itself sending (with NCCL a large send waits for its receive;
the ring back to stage 0 would otherwise close a cycle of waits whenever groups != stages).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from parallel_lib.common.timeline import Event, TimelineRecorder
from parallel_lib.inference.batch import Group, Request, Result
from parallel_lib.inference.engine import admit
from parallel_lib.inference.stage import Stage
from parallel_lib.pipeline_parallel.link import wait_for

__all__ = ["generation_schedule", "group_requests", "run_pipeline_stage"]


def group_requests(n: int, groups: int, max_batch: int) -> list[range]:
    """Positions ``0..n-1`` in contiguous groups: ``groups`` of them, or more where one would pass ``max_batch``."""
    size = min(max_batch, -(-n // max(1, groups)))  # ceil(n / groups), capped by the cache
    return [range(start, min(start + size, n)) for start in range(0, n, size)]


def generation_schedule(steps: Sequence[int]) -> list[tuple[int, int]]:
    """``(step, group)`` in the order every stage runs them: round ``t`` visits every group that has a step ``t``.

    >>> generation_schedule([3, 1])
    [(0, 0), (0, 1), (1, 0), (2, 0)]
    """
    return [(t, g) for t in range(max(steps, default=0)) for g, n in enumerate(steps) if t < n]


def run_pipeline_stage(stage: Stage, requests: Sequence[Request], rank: int, world_size: int, groups: int,
                       max_batch: int, vocab_size: int,
                       timeout: float) -> tuple[list[Result], list[Event], int, list[list[int]]]:
    """Rank ``rank``'s part of a pipelined generation (every rank calls it with the same requests).

    Returns:
        ``(results, events, kv_bytes, groups)``: the requests' results on the last stage (empty
        elsewhere), this stage's events (lane = the stage, micro-batch = the group), its KV caches'
        bytes (one cache per group in flight), and each group's request indices.
    """
    first, last = rank == 0, rank == world_size - 1
    indices = list(range(len(requests)))
    admitted, refused = admit(requests, indices, vocab_size)
    plan = [Group([requests[admitted[p]] for p in part], [admitted[p] for p in part], stage.device)
            for part in group_requests(len(admitted), groups, max_batch)]
    caches = [stage.new_cache(len(g), g.max_len) for g in plan]
    recorder = TimelineRecorder()
    dist.barrier()  # every stage starts its clock together: one time axis for the whole pipeline
    recorder.reset()
    tokens: dict[int, torch.Tensor] = {}
    events: list[Event] = []
    pending: list[tuple[Any, str, torch.Tensor]] = []
    for step, g in generation_schedule([group.steps for group in plan]):
        group = plan[g]
        if step == 0:
            inputs = group.prefill()
        else:
            if first and not last:  # the tokens of the step before, from the last stage
                tokens[g] = _receive((len(group),), torch.long, world_size - 1, stage, timeout,
                                     f"tokens of group {g} step {step - 1}")
            # later stages need the step's slots and mask, not its token ids
            inputs = group.decode(step, tokens.get(g, torch.zeros(len(group), dtype=torch.long)))
        b, s = inputs.shape
        x = inputs.ids if first else _receive((b, s, stage.width), torch.float32, rank - 1, stage, timeout,
                                                f"hidden state of group {g} step {step}")
        start = recorder.now()
        out = stage(inputs, x, caches[g])
        if last:
            tokens[g] = group.accept(step, out.float().cpu(), start, recorder.now())
        events.append(Event(stage.lane, "decode" if step else "prefill", g, start, recorder.now(), f"g{g}"))
        if not last:
            pending.append(_send(out, rank + 1, f"{stage.lane} sending group {g} step {step}"))
        elif not first and step + 1 < group.steps:
            pending.append(_send(tokens[g].to(stage.device), 0, f"{stage.lane} sending the tokens of group {g}"))
    for work, what, _ in pending:
        wait_for(work, timeout, what)
    results = sorted(refused + [r for group in plan for r in group.results], key=lambda r: r.index) if last else []
    for r in results:
        r.served_by = f"stages 0..{world_size - 1}" if r.ok or r.tokens else r.served_by
    return results, events, sum(c.nbytes() for c in caches), [group.indices for group in plan]


def _send(tensor: torch.Tensor, dst: int, what: str) -> tuple[Any, str, torch.Tensor]:
    tensor = tensor.contiguous()  # kept with the work until it is waited for
    (work,) = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, dst)])
    return work, what, tensor


def _receive(shape: tuple[int, ...], dtype: torch.dtype, src: int, stage: Stage, timeout: float,
             what: str) -> torch.Tensor:
    buffer = torch.empty(shape, dtype=dtype, device=stage.device)
    (work,) = dist.batch_isend_irecv([dist.P2POp(dist.irecv, buffer, src)])
    wait_for(work, timeout, f"{stage.lane} waiting for the {what} from rank {src}")
    return buffer
