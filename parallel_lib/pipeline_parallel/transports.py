"""The two links the pipeline runtime runs over: threads of one process, or processes.

:class:`ThreadLink` (the :class:`~parallel_lib.pipeline_parallel.Pipe`): ranks are worker threads;
a stage's output goes into a mailbox shared by the step's threads, keyed by what it is
(``("F", s, i)``: stage s's activation of micro-batch i; ``("B", s, i)``: the gradient of stage
s's input), and the stage that needs it waits there. Nothing is copied; a step that was
stopped (another rank failed, the caller timed out) wakes every waiting rank.

:class:`ProcessLink`: ranks are processes. Before each action the rank runs the exchanges its
plan puts there (:func:`~parallel_lib.pipeline_parallel.link.plan_exchanges`: every exchange
ONE ``batch_isend_irecv`` on the pipeline group, paired or in rounds, whichever
:func:`~parallel_lib.pipeline_parallel.link.find_deadlock` accepts); receive buffers take the
sender's dtype and shape from a spec both sides share, on the stage's device. A hand-over
between two stages of the same rank (the turn of a V) stays in memory.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

from parallel_lib.pipeline_parallel.link import Message, StageLink, TensorSpec, _messages, plan_exchanges
from parallel_lib.pipeline_parallel.schedule import Action, Schedule
from parallel_lib.pipeline_parallel.stage import TensorOrTensors

__all__ = ["Cancelled", "Mailbox", "ThreadLink", "ProcessLink"]

Key = tuple[str, int, int]  # ("F", s, i): stage s's output of micro-batch i; ("B", s, i): its input's gradient
_POLL_S = 0.02  # a waiting rank re-checks whether the step was stopped this often


class Cancelled(Exception):
    """The step was stopped while this rank waited (another rank failed, or the caller gave up)."""


def input_key(schedule: Schedule, rank: int, action: Action) -> Optional[Key]:
    """What ``action`` needs from another stage: the previous stage's F, the next stage's B, or nothing."""
    s, i = schedule.stage_of(rank, action), action.micro_batch
    if action.kind == "F" and s > 0:
        return ("F", s - 1, i)
    if action.kind == "B" and s < schedule.num_model_stages - 1:
        return ("B", s + 1, i)
    return None


class Mailbox:
    """The hand-overs of one threaded step; ``take`` waits until the key is there or the step is stopped."""

    def __init__(self, stopped: threading.Event) -> None:
        self._items: dict[Key, Any] = {}
        self._ready = threading.Condition()
        self.stopped = stopped

    def put(self, key: Key, value: Any) -> None:
        with self._ready:
            self._items[key] = value
            self._ready.notify_all()

    def take(self, key: Key) -> Any:
        """The value under ``key``, removed; raises :class:`Cancelled` once the step is stopped."""
        with self._ready:
            while key not in self._items:
                if self.stopped.is_set():
                    raise Cancelled(f"stopped while waiting for {key}")
                self._ready.wait(_POLL_S)
            return self._items.pop(key)


class ThreadLink:
    """A rank (worker thread) of a threaded pipeline: hand-overs through the step's :class:`Mailbox`."""

    def __init__(self, schedule: Schedule, rank: int, mailbox: Mailbox) -> None:
        self.schedule, self.rank, self.mailbox = schedule, rank, mailbox

    def recv(self, action: Action) -> Optional[TensorOrTensors]:
        if self.mailbox.stopped.is_set():  # early stop: nothing after a failure runs
            raise Cancelled(f"stopped before {action}")
        key = input_key(self.schedule, self.rank, action)
        return None if key is None else self.mailbox.take(key)

    def send(self, action: Action, value: Optional[TensorOrTensors]) -> None:
        if value is not None:
            self.mailbox.put((action.kind, self.schedule.stage_of(self.rank, action), action.micro_batch), value)

    def close(self) -> None:
        pass


class ProcessLink:
    """A rank (process) of a pipeline: its plan's exchanges over a
    :class:`~parallel_lib.pipeline_parallel.link.StageLink`.

    Args:
        schedule: the step's schedule (the same on every rank).
        rank: this rank's index in the pipeline (its list in ``schedule.stages``).
        link: the connection to the other ranks, on the pipeline group; its ``route`` is set here
            from the schedule's placement (``ranks[r]``: the global rank of pipeline rank r).
        ranks: global rank of every pipeline rank, in pipeline order (``mesh.peers("pp")``).
        spec: ``(shape, dtype)`` of a message's tensor, as the sender makes it.

    Raises:
        ValueError: a schedule no exchange plan runs without a deadlock (see ``plan_exchanges``).
    """

    def __init__(self, schedule: Schedule, rank: int, link: StageLink, ranks: list[int],
                 spec: Callable[[Message], TensorSpec]) -> None:
        self.schedule, self.rank, self.link, self.spec = schedule, rank, link, spec
        link.route = lambda message, sending: ranks[message.ranks(schedule, rank, sending)[1 if sending else 0]]
        self.plan = plan_exchanges(schedule)[rank]
        self._next_exchange = 0
        self._position = 0  # index of the next action
        self.inbox: dict[Message, Any] = {}
        self.outbox: dict[Message, Any] = {}
        self.local: dict[Key, Any] = {}  # hand-overs between stages of this rank

    def _exchange_before(self, k: int) -> None:
        """Run every planned exchange up to the one(s) before action k, each one ``batch_isend_irecv``."""
        while self._next_exchange < len(self.plan) and self.plan[self._next_exchange].before <= k:
            e = self.plan[self._next_exchange]
            received = self.link.exchange([(m, self.outbox.pop(m)) for m in e.sends], e.recvs, self.spec)
            self.inbox.update(zip(e.recvs, received))
            self._next_exchange += 1

    def recv(self, action: Action) -> Optional[TensorOrTensors]:
        self._exchange_before(self._position)
        self._position += 1
        messages = _messages(self.schedule, self.rank, action, out=False)
        if messages:
            return self.inbox.pop(messages[0])
        key = input_key(self.schedule, self.rank, action)
        return None if key is None else self.local.pop(key)

    def send(self, action: Action, value: Optional[TensorOrTensors]) -> None:
        if value is None:
            return
        messages = _messages(self.schedule, self.rank, action, out=True)
        if messages:
            self.outbox[messages[0]] = value
        else:  # the next stage (F) or the previous one (B) lives on this rank
            self.local[(action.kind, self.schedule.stage_of(self.rank, action), action.micro_batch)] = value

    def close(self) -> None:
        self._exchange_before(len(self.schedule.stages[self.rank]))
