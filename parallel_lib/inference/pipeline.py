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

**One runtime.** Generation runs on the pipeline runtime training uses
(:func:`~parallel_lib.pipeline_parallel.runtime.run_actions` over a
:class:`~parallel_lib.pipeline_parallel.transports.ProcessLink`), as a forward-only schedule
(:func:`generation_pipeline`): step ``t`` of stage ``s`` is model stage ``t·p + s``, placed on
rank ``s`` (a loop, like interleaving's), and a group is a micro-batch. Stage ``s`` hands each
item's hidden state (b, s, n_embd) to stage ``s + 1``; the last stage's sampled tokens (b,) are
the "activation" of stage 0's next step. A group that has finished sends nothing on. Every
exchange is one ``dist.batch_isend_irecv`` on the pipeline group, no tags, in a plan
:func:`~parallel_lib.pipeline_parallel.link.find_deadlock` accepts: with NCCL a large send waits
for its receive, and the ring back to stage 0 closes a cycle of waits that a careless order hangs on.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from parallel_lib.common.timeline import Event, TimelineRecorder
from parallel_lib.inference.batch import Group, Request, Result
from parallel_lib.inference.engine import admit
from parallel_lib.inference.stage import Stage
from parallel_lib.pipeline_parallel.link import Message, StageLink, TensorSpec, wait_for
from parallel_lib.pipeline_parallel.runtime import run_actions
from parallel_lib.pipeline_parallel.schedule import Action, Schedule
from parallel_lib.pipeline_parallel.transports import ProcessLink

__all__ = ["generation_schedule", "generation_pipeline", "group_requests", "run_pipeline_stage"]


def group_requests(n: int, groups: int, max_batch: int) -> list[range]:
    """Positions ``0..n-1`` in contiguous groups: ``groups`` of them, or more where one would pass ``max_batch``.

    No positions (every request refused) make no groups.
    """
    if n == 0:
        return []
    size = min(max_batch, -(-n // max(1, groups)))  # ceil(n / groups), capped by the cache
    return [range(start, min(start + size, n)) for start in range(0, n, size)]


def generation_schedule(steps: Sequence[int]) -> list[tuple[int, int]]:
    """``(step, group)`` in the order every stage runs them: round ``t`` visits every group that has a step ``t``.

    >>> generation_schedule([3, 1])
    [(0, 0), (0, 1), (1, 0), (2, 0)]
    """
    return [(t, g) for t in range(max(steps, default=0)) for g, n in enumerate(steps) if t < n]


def generation_pipeline(steps: Sequence[int], p: int) -> Schedule:
    """The forward-only schedule of a pipelined generation: F of group g on model stage ``t·p + s`` for step t.

    Every rank runs the items of :func:`generation_schedule` in its order; rank s holds stages
    ``s, p + s, 2p + s, ...``.

    >>> print(generation_pipeline([2, 1], 2))
    generation, p=2, m=2
    rank 0: F0s0 F1s0 F0s2
    rank 1: F0s1 F1s1 F0s3
    """
    items = generation_schedule(steps)
    stages = tuple(tuple(Action("F", g, t * p + s) for t, g in items) for s in range(p))
    return Schedule("generation", p, len(steps), stages, tuple(v % p for v in range(p * max(steps, default=0))))


class _Generation:
    """What one rank computes for each item: its stage on the group's step; the last stage samples."""

    def __init__(self, stage: Stage, plan: list[Group], p: int, recorder: TimelineRecorder) -> None:
        self.stage, self.plan, self.p, self.recorder = stage, plan, p, recorder
        self.caches = [stage.new_cache(len(g), g.max_len) for g in plan]
        self.events: list[Event] = []

    def forward(self, action: Action, x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Stage s at step t of group g: x is the tokens of step t-1 (stage 0) or the hidden state (later stages)."""
        step, s = divmod(action.stage, self.p)  # type: ignore[operator]
        g, group, stage = action.micro_batch, self.plan[action.micro_batch], self.stage
        if step == 0:
            inputs = group.prefill()
        else:  # later stages need the step's slots and mask, not its token ids
            tokens = x if stage.first else torch.zeros(len(group), dtype=torch.long)
            inputs = group.decode(step, tokens)
        start = self.recorder.now()
        out = stage(inputs, inputs.ids if stage.first else x, self.caches[g])
        end = self.recorder.now()
        if stage.last:
            tokens = group.accept(step, out.float().cpu(), start, end)
            end = self.recorder.now()
        self.events.append(Event(stage.lane, "decode" if step else "prefill", g, start, end, f"g{g}"))
        if not stage.last:
            return out
        return tokens.to(stage.device) if step + 1 < group.steps else None  # the group's next step, on stage 0


def _spec(plan: list[Group], p: int, width: int, dtype: torch.dtype) -> Any:
    """``(shape, dtype)`` of a message, as its sender makes it: tokens for stage 0, else a hidden state."""
    def spec(message: Message) -> TensorSpec:
        step, s = divmod(message.stage, p)  # type: ignore[operator]
        group = plan[message.micro_batch]
        if s == 0:
            return (len(group),), torch.long
        return (len(group), int(group.lengths.max()) if step == 0 else 1, width), dtype
    return spec


def run_pipeline_stage(stage: Stage, requests: Sequence[Request], rank: int, world_size: int, groups: int,
                       max_batch: int, vocab_size: int, timeout: float, *,
                       group: Any) -> tuple[list[Result], list[Event], int, list[list[int]]]:
    """Rank ``rank``'s part of a pipelined generation (every rank calls it with the same requests).

    Args:
        group: the pipeline's process group (``mesh.group("pp")``); ranks 0..world_size-1 of it, in stage order.

    Returns:
        ``(results, events, kv_bytes, groups)``: the requests' results on the last stage (empty
        elsewhere), this stage's events (lane = the stage, micro-batch = the group), its KV caches'
        bytes (one cache per group in flight), and each group's request indices.

    Raises:
        TimeoutError: a message did not come within ``timeout`` (naming it and the peer).
    """
    last = rank == world_size - 1
    indices = list(range(len(requests)))
    admitted, refused = admit(requests, indices, vocab_size)
    if not admitted:  # every rank refused every request alike: nothing to run, nothing to exchange
        return (refused if last else []), [], 0, []
    plan = [Group([requests[admitted[p]] for p in part], [admitted[p] for p in part], stage.device)
            for part in group_requests(len(admitted), groups, max_batch)]
    schedule = generation_pipeline([g.steps for g in plan], world_size)
    recorder = TimelineRecorder()
    work = _Generation(stage, plan, world_size, recorder)
    dtype = next(stage.parameters()).dtype  # the hidden states every stage sends: the model's dtype
    link = StageLink(None, None, stage.lane, timeout, stage.device, group=group)
    transport = ProcessLink(schedule, rank, link, dist.get_process_group_ranks(group),
                            _spec(plan, world_size, stage.width, dtype))
    wait_for(dist.barrier(group=group, async_op=True), timeout, f"{stage.lane}: start-up barrier")
    recorder.reset()  # every stage starts its clock together: one time axis for the whole pipeline
    run_actions(schedule, rank, work, transport)  # type: ignore[arg-type]
    results = sorted(refused + [r for g in plan for r in g.results], key=lambda r: r.index) if last else []
    for r in results:
        r.served_by = f"stages 0..{world_size - 1}" if r.ok or r.tokens else r.served_by
    return results, work.events, sum(c.nbytes() for c in work.caches), [g.indices for g in plan]
