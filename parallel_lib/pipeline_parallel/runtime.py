"""The pipeline runtime: one function runs a rank's actions, whatever carries the tensors.

A schedule gives every rank its ordered actions (``F``, ``B``, ``W``). Running them is the
same loop everywhere; only the *link* that hands tensors to the other ranks differs:

- threads (:class:`~parallel_lib.pipeline_parallel.Pipe`, chapters 04 and 08): every rank is a
  worker thread of one process, a hand-over is a Python object in a shared mailbox
  (:class:`~parallel_lib.pipeline_parallel.transports.ThreadLink`);
- processes (chapters 05, 08, 09, 10): every rank is a process, and between two actions it
  sends and receives in ONE ``dist.batch_isend_irecv`` on the pipeline group's communicator,
  following an exchange plan that completes under NCCL's blocking rule
  (:class:`~parallel_lib.pipeline_parallel.transports.ProcessLink`).

What a rank computes is :class:`RankStages`: the model stages it holds, each a
:class:`~parallel_lib.pipeline_parallel.stage.StageRunner`, with what backward and W need, the
losses, and the memory counters::

    for action in schedule.stages[rank]:
        received = link.recv(action)                              [1]
        if action.kind == "F": link.send(action, stages.forward(action, received))   [2]
        ...
    link.close()                                                  [3]

[1] the exchanges planned before the action (threads: wait for its input in the mailbox);
    its input, or None (the batch on the first stage, the loss on the last);
[2] what the action made goes to the stage that needs it: another rank's (a message) or
    this rank's (a V's turn, in memory);
[3] the exchanges planned after the last action (the last gradients sent).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

from torch import Tensor

from parallel_lib.pipeline_parallel.schedule import Action, Schedule
from parallel_lib.pipeline_parallel.stage import StageRunner, TensorOrTensors

__all__ = ["Link", "RankStages", "run_actions"]

Timed = Callable[[Action, Callable[[], Any]], Any]  # runs one action's compute (timing it, reporting it)


class Link(Protocol):
    """How a rank's stages get their inputs from, and hand their outputs to, the other stages."""

    def recv(self, action: Action) -> Optional[TensorOrTensors]:
        """Run what must happen before ``action``; return its input (None: it needs none from another stage)."""

    def send(self, action: Action, value: Optional[TensorOrTensors]) -> None:
        """Hand what ``action`` made (None: nothing) to the stage that needs it."""

    def close(self) -> None:
        """Run what must happen after the rank's last action."""


def run_actions(schedule: Schedule, rank: int, stages: RankStages, link: Link) -> None:
    """Run rank ``rank``'s actions of ``schedule`` in order; ``link`` carries the tensors between ranks.

    Raises:
        Whatever a stage or the link raises (a failed stage, a timeout naming the message).
    """
    for action in schedule.stages[rank]:
        received = link.recv(action)  # [1]
        if action.kind == "F":
            link.send(action, stages.forward(action, received))  # [2]
        elif action.kind == "B":
            link.send(action, stages.backward(action, received))
        else:
            stages.weight(action)
    link.close()  # [3]


def _run(action: Action, compute: Callable[[], Any]) -> Any:
    return compute()


class RankStages:
    """The model stages one rank holds, for one step: forward, backward and W of each action.

    Args:
        schedule: the step's schedule.
        rank: this rank.
        runners: the runner of every model stage this rank holds, by model stage.
        inputs: the first stage's micro-batches (``inputs[i]``); unused on other ranks.
        loss: ``loss(i)`` maps the last stage's output of micro-batch i to its weighted loss
            (training only).
        train: False runs the stages without cutting (inference; with grad on, ``pipe(x)``'s
            outputs stay attached to every stage's graph).
        recompute: ``recompute(i)``: micro-batch i keeps only its input and runs its forward again at B
            (not training, with grad on: in autograd's backward of the output, see ``StageRunner.run``).
        timed: ``timed(action, compute)`` runs one action's compute (the Pipe times it on the
            timeline and reports it done; a rank process records an event).

    Attributes:
        losses: micro-batch -> its weighted loss (detached), on the rank of the last stage.
        outputs: micro-batch -> the last stage's output when not training.
        peak, peak_bytes: most micro-batch activations this rank held at once, and the most
            bytes autograd had saved for them (stage-activations: a micro-batch on one stage).
    """

    def __init__(self, schedule: Schedule, rank: int, runners: Mapping[int, StageRunner],
                 inputs: Sequence[TensorOrTensors] = (), loss: Optional[Callable[[int], Callable[..., Tensor]]] = None,
                 train: bool = True, recompute: Optional[Callable[[int], bool]] = None,
                 timed: Optional[Timed] = None) -> None:
        self.schedule, self.rank, self.runners, self.inputs = schedule, rank, dict(runners), inputs
        self.loss, self.train = loss, train
        self.recompute = recompute or (lambda i: False)
        self.timed = timed or _run
        self.last = schedule.num_model_stages - 1
        self.split = schedule.split_backward
        self.saved: dict[tuple[int, int], Any] = {}  # (s, i): what backward needs
        self.for_w: dict[tuple[int, int], Any] = {}  # (s, i): what W needs, after B
        self.losses: dict[int, Tensor] = {}
        self.outputs: dict[int, TensorOrTensors] = {}
        self.live = self.peak = self.live_bytes = self.peak_bytes = 0
        self._bytes: dict[tuple[int, int], int] = {}

    def _stage(self, action: Action) -> tuple[int, int, StageRunner]:
        s = self.schedule.stage_of(self.rank, action)
        return s, action.micro_batch, self.runners[s]

    def forward(self, action: Action, x: Optional[TensorOrTensors]) -> Optional[TensorOrTensors]:
        """F: the stage's output for the next stage (None on the last stage, which keeps the loss)."""
        s, i, runner = self._stage(action)
        x = self.inputs[i] if s == 0 else x
        if not self.train:
            y = self.timed(action, lambda: runner.run(x, recompute=self.recompute(i)))
            if s == self.last:
                self.outputs[i] = y
                return None
            return y
        loss = self.loss(i) if s == self.last and self.loss is not None else None

        def compute() -> tuple[Any, Any, int]:  # saved bytes read on the thread that ran the forward
            saved, y = runner.forward(x, loss, recompute=self.recompute(i), split=self.split)
            return saved, y, runner.last_saved_bytes

        self.saved[(s, i)], y, self._bytes[(s, i)] = self.timed(action, compute)
        self.live += 1
        self.live_bytes += self._bytes[(s, i)]
        self.peak, self.peak_bytes = max(self.peak, self.live), max(self.peak_bytes, self.live_bytes)
        if s == self.last:
            self.losses[i] = y
            return None
        return y

    def backward(self, action: Action, grad: Optional[TensorOrTensors]) -> Optional[TensorOrTensors]:
        """B: the gradient of the stage's input, for the previous stage (None on the first stage)."""
        s, i, runner = self._stage(action)
        saved = self.saved.pop((s, i))
        if self.split:
            grad_x, self.for_w[(s, i)] = self.timed(action, lambda: runner.backward_input(saved, grad))
        else:
            grad_x = self.timed(action, lambda: runner.backward(saved, grad))
            self._release(s, i)
        return grad_x if s > 0 else None

    def weight(self, action: Action) -> None:
        """W: the weight gradients of a split backward."""
        s, i, runner = self._stage(action)
        todo = self.for_w.pop((s, i))
        self.timed(action, lambda: runner.backward_weight(todo))
        self._release(s, i)

    def _release(self, s: int, i: int) -> None:
        self.live -= 1
        self.live_bytes -= self._bytes.pop((s, i))

    def loss_sum(self) -> float:
        """The sum of this rank's micro-batch losses (0.0 on a rank without the last stage)."""
        return float(sum(float(loss) for loss in self.losses.values()))
