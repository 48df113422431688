"""Stages on different ranks: which tensors a stage exchanges with its neighbours, and when.

Between two actions of its schedule a stage sends what the last action produced and
receives what the next one needs, and both go out in ONE ``dist.batch_isend_irecv``
(an *exchange*), as Megatron-LM pairs ``send_forward_recv_backward``::

    stage j, 1F1B steady state          exchange between F(i) and B(i')
    ... F(i) ──> [ send act(i) to j+1 | recv grad(i') from j+1 ] ──> B(i') ...

Why pair them. NCCL blocks a send larger than its eager buffer (about 4 MiB; a 124M
GPT-2's activation is ~25 MB) until the peer has posted the matching receive, and runs a
rank's operations in order. If stage j posts "send activation" while stage j+1 posts
"send gradient", each waits for a receive the other has not posted yet: deadlock. In one
batch, a send and a receive progress together. Gloo's blocking send waits for its receive
as well (it does not buffer), so the rule is not NCCL's alone; :func:`find_deadlock` replays
exchange plans under it (every message waits for its partner) so a CPU test can show that the
paired plan completes and the unpaired one does not.

No tags: NCCL ignores them. Messages between two ranks match in the order they were
posted, per direction, and each stage's plan follows the schedule's order, so the k-th
activation j sends is the k-th one j+1 receives (:func:`find_deadlock` checks that too).

Schedules whose ranks hold several model stages (interleaved, the V schedules) deadlock with
that pairing: a rank may wait to send a gradient to a neighbour that itself waits to send an
activation. For them every rank exchanges in *rounds* (:func:`round_plans`): replay the
schedule one action per rank and tick, and after each tick every message sent in it is
received in the same exchange, by both sides. The tick-r exchange of one rank then only waits
for the tick-r exchanges of its peers, which every rank reaches, so the plan completes (what
Megatron-LM's interleaved schedule does with ``send_forward_backward_recv_forward_backward``).
:func:`plan_exchanges` picks the pairing when :func:`find_deadlock` accepts it, else the rounds,
and refuses a schedule neither can run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Literal, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from parallel_lib.pipeline_parallel.schedule import Action, Schedule, action_ready
from parallel_lib.runtime.waiting import wait_for  # re-exported: the stages' waits

__all__ = ["Message", "Exchange", "exchange_plan", "round_plans", "plan_exchanges", "find_deadlock", "StageLink",
           "TensorSpec", "wait_for", "leave_together"]

TensorSpec = tuple[Sequence[int], torch.dtype]  # (shape, dtype) of a message's tensor, as its sender makes it


@dataclass(frozen=True)
class Message:
    """One tensor between stages on different ranks: micro-batch i's activation or gradient.

    ``stage`` is the model stage the tensor is for (an activation goes to stage s from s-1, a
    gradient to stage s from s+1); None when every rank holds one stage (then the neighbour is
    the next rank for activations and the previous one for gradients).
    """

    kind: Literal["activation", "gradient"]
    micro_batch: int
    stage: Optional[int] = None

    def __str__(self) -> str:
        return f"{self.kind} {self.micro_batch}" + ("" if self.stage is None else f" for stage {self.stage}")

    @property
    def step(self) -> int:
        """The neighbour it goes to (+1 for activations) or comes from, relative to the stage."""
        return 1 if self.kind == "activation" else -1

    def ranks(self, schedule: Schedule, me: int, sending: bool) -> tuple[int, int]:
        """``(source rank, destination rank)`` of this message as rank ``me`` sends or receives it."""
        if self.stage is None:
            return (me, me + self.step) if sending else (me - self.step, me)
        source_stage = self.stage - self.step
        return schedule.placement[source_stage], schedule.placement[self.stage]


@dataclass
class Exchange:
    """What a stage sends and receives in one ``batch_isend_irecv``, before action ``before``."""

    before: int  # index of the next action in the stage's list (== len(list) after the last)
    sends: list[Message] = field(default_factory=list)
    recvs: list[Message] = field(default_factory=list)

    def __str__(self) -> str:
        parts = [f"send {', '.join(map(str, self.sends))}"] * bool(self.sends)
        parts += [f"receive {', '.join(map(str, self.recvs))}"] * bool(self.recvs)
        return "[" + " | ".join(parts) + "]"


def _messages(schedule: Schedule, j: int, action: Action, out: bool) -> list[Message]:
    """What ``action`` on rank j sends (``out``) or must receive first, to or from another rank."""
    s, i, place = schedule.stage_of(j, action), action.micro_batch, schedule.placement
    one = schedule.placement == tuple(range(schedule.num_stages)) and action.stage is None
    if action.kind == "W":
        return []
    if action.kind == "F":
        to = s + 1 if out else s  # the stage the activation is for
        kind: Literal["activation", "gradient"] = "activation"
        other = to if out else s - 1
    else:
        to = s - 1 if out else s
        kind = "gradient"
        other = to if out else s + 1
    if not 0 <= other < len(place) or place[other] == j:
        return []  # no neighbour, or the neighbour stage lives on this rank: no message
    if (action.kind, other, i) not in _runs(schedule):
        return []  # the neighbour stage never runs this micro-batch (a generation's finished group)
    return [Message(kind, i, None if one else to)]


@lru_cache(maxsize=64)
def _runs(schedule: Schedule) -> frozenset[tuple[str, int, int]]:
    """Every (kind, model stage, micro-batch) the schedule runs."""
    return frozenset((a.kind, schedule.stage_of(j, a), a.micro_batch)
                     for j, actions in enumerate(schedule.stages) for a in actions)


def exchange_plan(schedule: Schedule, j: int, paired: bool = True, sender_order: bool = False) -> list[Exchange]:
    """Rank j's exchanges, in order: the sends of action k-1 with the receives of action k.

    Where W actions come just before action k (they neither send nor receive), action k's
    receives are posted with the sends before the first of them: a zero-bubble schedule's W
    then runs while the neighbour computes, instead of between a send that waits for the
    neighbour's receive and a receive the neighbour's send waits for (ZB-H1 on the last of two
    ranks: F1 B1 [send g1, receive a2] W0 F2, not F1 B1 [send g1] W0 [receive a2] F2, where the
    first rank waits through W0 to hand over a2).

    Args:
        schedule: the pipeline's schedule.
        j: the rank.
        paired: False gives one exchange per message, sends right after their action and
            receives right before theirs: the pattern that deadlocks on NCCL.
        sender_order: receive, with a message, every message its sender sent before it on the
            same channel. Needed when one channel carries both activations and gradients (the V
            schedules: rank 0 sends rank 1 activations of stage 0 and gradients of stage 2p-1) and
            the sender's order differs from the order they are needed in: without tags the k-th
            message sent is the k-th received.
    """
    actions = schedule.stages[j]
    queues = _channel_orders(schedule, j) if sender_order else {}
    plan: list[Exchange] = []
    early: set[Message] = set()  # received before they were needed
    for k in range(len(actions) + 1):
        sends = _messages(schedule, j, actions[k - 1], out=True) if k > 0 else []
        recvs = _messages(schedule, j, actions[k], out=False) if k < len(actions) else []
        if sender_order:
            wanted, recvs = [m for m in recvs if m not in early], []
            for m in wanted:
                queue = queues[m.ranks(schedule, j, sending=False)[0]]
                while m not in recvs:
                    recvs.append(queue.pop(0))
            early.update(recvs)
        if paired:
            first_w = k
            while first_w > 0 and actions[first_w - 1].kind == "W":
                first_w -= 1
            plan.append(Exchange(k, sends, []))
            plan[first_w].recvs.extend(recvs)  # plan[i] is the exchange before action i
        else:
            plan += [Exchange(k, [m], []) for m in sends] + [Exchange(k, [], [m]) for m in recvs]
    return [e for e in plan if e.sends or e.recvs]


def _channel_orders(schedule: Schedule, j: int) -> dict[int, list[Message]]:
    """Per source rank, the messages it sends rank j, in the order it sends them."""
    orders: dict[int, list[Message]] = {}
    for src, actions in enumerate(schedule.stages):
        for action in actions:
            for m in _messages(schedule, src, action, out=True):
                if m.ranks(schedule, src, sending=True)[1] == j:
                    orders.setdefault(src, []).append(m)
    return orders


def round_plans(schedule: Schedule) -> list[list[Exchange]]:
    """Every rank's exchanges when the ranks exchange in rounds: each message is received in the tick it is sent.

    Replays the schedule one tick at a time: in each tick every rank runs its next action if
    its inputs were made in an earlier tick (:func:`~parallel_lib.pipeline_parallel.schedule.action_ready`);
    then each rank that sent or is sent something posts one exchange with all of it. Several
    exchanges may come before one action (a rank that waits receives what its peers send meanwhile).

    Raises:
        ValueError: the schedule stalls (no rank can run its next action).
    """
    p = schedule.num_stages
    position, done = [0] * p, set()
    plans: list[list[Exchange]] = [[] for _ in range(p)]
    while True:
        nexts = {j: schedule.stages[j][position[j]] for j in range(p) if position[j] < len(schedule.stages[j])}
        if not nexts:
            return plans
        ran = [(j, action) for j, action in nexts.items() if action_ready(schedule, j, action, done)]
        if not ran:
            waiting = ", ".join(f"rank {j}: {action}" for j, action in nexts.items())
            raise ValueError(f"schedule {schedule.name!r} stalls: no rank can run its next action ({waiting})")
        sent: list[tuple[int, Message]] = []
        for j, action in ran:
            position[j] += 1
            done.add((action.kind, schedule.stage_of(j, action), action.micro_batch))
            sent += [(j, m) for m in _messages(schedule, j, action, out=True)]
        for j in range(p):
            sends = [m for src, m in sent if src == j]
            recvs = [m for src, m in sent if m.ranks(schedule, src, sending=True)[1] == j]
            if sends or recvs:
                plans[j].append(Exchange(position[j], sends, recvs))


def plan_exchanges(schedule: Schedule) -> list[list[Exchange]]:
    """The exchanges every rank runs: paired in sender order if :func:`find_deadlock` accepts that, else in rounds.

    Raises:
        ValueError: neither plan completes under NCCL's blocking rule (naming why), or the schedule stalls.
    """
    paired = [exchange_plan(schedule, j, paired=True, sender_order=True) for j in range(schedule.num_stages)]
    verdict = find_deadlock(schedule, plans=paired)
    if verdict is None:
        return paired
    rounds = round_plans(schedule)
    in_rounds = find_deadlock(schedule, plans=rounds)
    if in_rounds is not None:
        raise ValueError(f"schedule {schedule.name!r} cannot run over processes: paired exchanges fail ({verdict}) "
                         f"and so do rounds ({in_rounds})")
    return rounds


def find_deadlock(schedule: Schedule, paired: bool = True, sender_order: bool = False,
                  plans: Optional[Sequence[Sequence[Exchange]]] = None) -> Optional[str]:
    """Replay every stage's exchanges as NCCL runs large messages; None if they all complete.

    Rules: a stage posts its exchanges one after another; an exchange completes once the
    partner of each of its messages is posted (a send waits for its receive and back);
    the n-th message from stage a to stage b is the n-th one b receives from a, and it
    must be the same micro-batch's tensor (no tags to sort them out).

    Args:
        plans: every rank's exchanges (e.g. :func:`round_plans`); default
            ``exchange_plan(schedule, j, paired, sender_order)`` for every rank j.

    Returns:
        None, or a description of where the stages wait on each other forever, or of a
        message received in place of another.
    """
    p = schedule.num_stages
    if plans is None:
        plans = [exchange_plan(schedule, j, paired, sender_order) for j in range(p)]
    # the n-th message on each directed channel (a, b): in which exchange of a (send) and b (recv)
    posted: dict[tuple[str, int, int, int], tuple[int, Message]] = {}
    for j, plan in enumerate(plans):
        counts: dict[tuple[str, int], int] = {}
        for e, exchange in enumerate(plan):
            for op, messages in (("send", exchange.sends), ("recv", exchange.recvs)):
                for m in messages:
                    src, dst = m.ranks(schedule, j, sending=op == "send")
                    peer = dst if op == "send" else src
                    n = counts[(op, peer)] = counts.get((op, peer), -1) + 1
                    posted[(op, src, dst, n)] = (e, m)
    for (op, src, dst, n), (_, m) in posted.items():
        other = posted.get(("recv" if op == "send" else "send", src, dst, n))
        if other is None or other[1] != m:
            return f"stage {src} -> {dst}, message {n}: {m} is matched with {other and other[1]}"
    at = [0] * p  # the exchange each stage has posted and waits on
    while any(at[j] < len(plans[j]) for j in range(p)):
        progressed = False
        for j in range(p):
            if at[j] < len(plans[j]) and _partners_posted(j, at, posted):
                at[j] += 1
                progressed = True
        if not progressed:
            waiting = [f"stage {j} waits in {plans[j][at[j]]}" for j in range(p) if at[j] < len(plans[j])]
            return "deadlock: " + "; ".join(waiting)
    return None


def _partners_posted(j: int, at: list[int], posted: dict[tuple[str, int, int, int], tuple[int, Message]]) -> bool:
    """Whether every message of stage j's current exchange has its partner posted."""
    for (op, src, dst, n), (e, _) in posted.items():
        me = src if op == "send" else dst
        if me == j and e == at[j]:
            partner_stage = dst if op == "send" else src
            partner_exchange = posted[("recv" if op == "send" else "send", src, dst, n)][0]
            if at[partner_stage] < partner_exchange:
                return False
    return True


def leave_together(group: Any, timeout: float) -> None:
    """Wait, at most ``timeout`` seconds, until every rank of ``group`` is done with it (a barrier; errors ignored).

    Call it before destroying a pipeline group: a rank that destroys it while a peer still waits
    for one of its messages turns the peer's clear timeout, which names the message and the rank,
    into a "connection closed" from the transport.
    """
    try:
        wait_for(dist.barrier(group=group, async_op=True), timeout, "leaving the pipeline group")
    except (TimeoutError, RuntimeError):
        pass


class StageLink:
    """One rank's connection to the ranks of its neighbouring stages, over the pipeline's process group.

    Args:
        prev: global rank of stage j-1 (None on the first stage).
        next: global rank of stage j+1 (None on the last stage).
        who: how error messages name this rank, e.g. "rank 1 (replica 0, stage 1)".
        timeout: seconds any exchange may wait.
        device: where received tensors are allocated: the device of the group's backend (the stage's).
        group: the pipeline's process group (e.g. ``mesh.group("pp")``); every message goes over its
            communicator, never the default group's.
    """

    def __init__(self, prev: Optional[int], next: Optional[int], who: str, timeout: float,
                 device: torch.device, *, group: Any) -> None:
        if group is None:
            raise ValueError(f"{who}: group must be the pipeline's process group (e.g. mesh.group('pp')), got None; "
                             "a pipeline never talks over the default group")
        self.prev, self.next, self.who, self.timeout, self.device = prev, next, who, timeout, device
        self.group = group
        self.route: Optional[Callable[[Message, bool], int]] = None  # (message, sending) -> peer rank
        self.bytes_sent = 0  # since the last reset

    def peer(self, message: Message, sending: bool) -> int:
        if self.route is not None:  # several stages per rank: the schedule's placement says who
            return self.route(message, sending)
        rank = self.next if (message.step > 0) == sending else self.prev
        if rank is None:
            raise ValueError(f"{self.who} has no neighbour for {message}")
        return rank

    def exchange(self, sends: Sequence[tuple[Message, Tensor]], recvs: Sequence[Message],
                 spec: Callable[[Message], TensorSpec]) -> list[Tensor]:
        """Post every send and receive in one ``batch_isend_irecv`` and wait for all; return the received.

        Args:
            sends: messages with their tensors.
            recvs: messages to receive.
            spec: ``(shape, dtype)`` of a message's tensor as its SENDER makes it (both sides know it
                from the batch and the model); receives are allocated so, on ``device``.

        Raises:
            ValueError: a tensor to send differs from its spec (the receiver would read it wrongly).
            TimeoutError: naming the message and the peer, after ``timeout`` seconds.
            RuntimeError: a peer failed (its connection closed).
        """
        ops, names = [], []
        received = []
        for m in recvs:
            shape, dtype = spec(m)
            received.append(torch.empty(tuple(shape), dtype=dtype, device=self.device))
        for m, buffer in zip(recvs, received):
            src = self.peer(m, sending=False)
            ops.append(dist.P2POp(dist.irecv, buffer, src, self.group))
            names.append(f"{self.who} waiting for the {_words(m)} from rank {src}")
        for m, tensor in sends:
            dst = self.peer(m, sending=True)
            shape, dtype = spec(m)
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise ValueError(f"{self.who} would send the {_words(m)} to rank {dst} as {tensor.dtype} "
                                 f"{tuple(tensor.shape)}, but rank {dst} expects {dtype} {tuple(shape)}: give both "
                                 f"sides the same spec (the sender's dtype and shape)")
            tensor = tensor.contiguous()
            ops.append(dist.P2POp(dist.isend, tensor, dst, self.group))
            names.append(f"{self.who} sending the {_words(m)} to rank {dst}")
            self.bytes_sent += tensor.numel() * tensor.element_size()
        if ops:
            for work, what in zip(dist.batch_isend_irecv(ops), names):  # receives first: the likelier wait
                wait_for(work, self.timeout, what)
        return received


def _words(m: Message) -> str:
    return ("activations" if m.kind == "activation" else "output gradient") + f" of micro-batch {m.micro_batch}"
