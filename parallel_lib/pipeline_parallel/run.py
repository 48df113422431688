"""What one call of a :class:`~parallel_lib.pipeline_parallel.Pipe` hands between its stages.

:class:`PipelineRun` turns an action of the schedule into the closure a rank's worker runs
(:meth:`PipelineRun.compute`) and files the result where the next actions look for it
(:meth:`PipelineRun.finish`). The stage work itself is
:class:`~parallel_lib.pipeline_parallel.stage.StageRunner`'s. Everything is keyed by model
stage s (a rank of an interleaved or V schedule runs several); memory is counted per rank.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Literal, Optional, Sequence, Union

from torch import Tensor, nn

from parallel_lib.model_parallel.device_map import DeviceMap
from parallel_lib.pipeline_parallel.microbatch import Target, split_layers
from parallel_lib.pipeline_parallel.schedule import Action, make_schedule, stages_per_rank
from parallel_lib.runtime.device import DeviceKey
from parallel_lib.pipeline_parallel.stage import Saved, StageRunner, TensorOrTensors

__all__ = ["PipelineRun", "StageError", "LossFn", "Checkpoint", "CHECKPOINTS", "layout", "sum_tied_gradients"]

LossFn = Callable[..., Tensor]
Checkpoint = Literal["never", "except_last", "always"]
CHECKPOINTS = ("never", "except_last", "always")  # torchgpipe's choices: which micro-batches recompute


class StageError(RuntimeError):
    """A stage raised while running an action; the original exception is the ``__cause__``.

    Attributes:
        stage: index of the failing stage.
        action: the failing action, e.g. ``B(2)``.
    """

    def __init__(self, stage: int, action: Action, error: BaseException) -> None:
        super().__init__(f"stage {stage} failed in {action} (micro-batch {action.micro_batch}): "
                         f"{type(error).__name__}: {error} (the step's gradients are partial: zero them "
                         f"before the next step)")
        self.stage = stage
        self.action = action


class PipelineRun:
    """One pass over the micro-batches: what stages hand each other and keep for backward.

    Args:
        placement: rank of each model stage (default: stage s on rank s).
        split: the schedule splits the backward into B and W.
        checkpoint: which micro-batches keep only their input and recompute the forward at B
            ("except_last": all but the last, whose backward starts right away, as in torchgpipe).
    """

    def __init__(self, runners: Sequence[StageRunner], inputs: list[TensorOrTensors], train: bool,
                 loss_fn: Optional[LossFn] = None, targets: Optional[list[Target]] = None,
                 weights: Optional[list[float]] = None, placement: Optional[Sequence[int]] = None,
                 split: bool = False, checkpoint: Checkpoint = "never") -> None:
        self.runners = list(runners)
        self.last = len(self.runners) - 1
        self.inputs, self.train, self.loss_fn = inputs, train, loss_fn
        self.targets, self.weights = targets, weights
        self.placement = list(placement if placement is not None else range(len(self.runners)))
        self.split, self.checkpoint = split, checkpoint
        self.activations: dict[tuple[int, int], TensorOrTensors] = {}  # (s, i): stage s's output for i
        self.input_grads: dict[tuple[int, int], TensorOrTensors] = {}  # (s, i): gradient of stage s's input
        self.saved: dict[tuple[int, int], Saved] = {}  # (s, i): what backward needs
        self.for_w: dict[tuple[int, int], Any] = {}  # (s, i): what W needs, after B
        self.outputs: dict[int, TensorOrTensors] = {}  # i: last stage's output (forward pass)
        self.losses: dict[int, Tensor] = {}  # i: weighted loss of micro-batch i
        ranks = 1 + max(self.placement)
        self.live = [0] * ranks  # stage-activations a rank holds now (a micro-batch on one of its stages)
        self.peak = [0] * ranks
        self.live_bytes, self.peak_bytes = [0] * ranks, [0] * ranks
        self._bytes: dict[tuple[int, int], int] = {}

    def _recompute(self, i: int) -> bool:
        return self.checkpoint == "always" or (self.checkpoint == "except_last" and i < len(self.inputs) - 1)

    def compute(self, s: int, action: Action) -> Callable[[], Any]:
        """The closure a worker runs for ``action`` on model stage s (inputs taken out of the run)."""
        i, runner = action.micro_batch, self.runners[s]
        if action.kind == "W":
            return partial(runner.backward_weight, self.for_w.pop((s, i)))
        if action.kind == "B":  # backward(z, grad_z); returns the gradient of the stage's input
            grad = None if s == self.last else self.input_grads.pop((s + 1, i))
            return partial(runner.backward_input if self.split else runner.backward, self.saved.pop((s, i)), grad)
        x = self.inputs[i] if s == 0 else self.activations.pop((s - 1, i))
        if not self.train:  # inference, or pipe(x) with grad on: the stages' graphs stay connected
            return partial(runner.run, x)
        loss = self._loss(i) if s == self.last else None

        def forward() -> Any:  # the saved bytes travel back with the result: runners are shared by threads
            saved, y = runner.forward(x, loss, recompute=self._recompute(i))
            return saved, y, runner.last_saved_bytes
        return forward

    def _loss(self, i: int) -> Callable[[TensorOrTensors], Tensor]:
        """Micro-batch i's weighted loss, computed on the last stage's device."""
        target = self.targets[i]  # type: ignore[index]
        targets = [target] if isinstance(target, Tensor) else list(target)
        device = self.runners[self.last].device
        return lambda y: self.loss_fn(y, *(t.to(device) for t in targets)) * self.weights[i]  # type: ignore

    def finish(self, s: int, action: Action, result: Any) -> None:
        """Store what ``action`` on stage s produced where the next actions will look for it."""
        i, r = action.micro_batch, self.placement[s]
        if action.kind == "B" and self.split:
            result, self.for_w[(s, i)] = result
        if action.kind == "W" or (action.kind == "B" and not self.split):
            self.live[r] -= 1
            self.live_bytes[r] -= self._bytes.pop((s, i))
        if action.kind == "B":
            if s > 0:
                self.input_grads[(s, i)] = result
            return
        if action.kind == "W":
            return
        if self.train:
            self.saved[(s, i)], result, self._bytes[(s, i)] = result
            self.live[r] += 1
            self.live_bytes[r] += self._bytes[(s, i)]
            self.peak[r] = max(self.peak[r], self.live[r])
            self.peak_bytes[r] = max(self.peak_bytes[r], self.live_bytes[r])
        if s < self.last:
            self.activations[(s, i)] = result
        elif self.train:
            self.losses[i] = result
        else:
            self.outputs[i] = result


def layout(n_layers: int, devices: Union[Sequence[DeviceKey], DeviceMap], schedule: str
           ) -> tuple[list[DeviceKey], list[list[int]], tuple[int, ...]]:
    """``(device key per rank, layer indices per model stage, rank per model stage)`` for a schedule.

    Raises:
        ValueError: a device map for a schedule with several stages per device (it places them itself).
    """
    keys, stage_layers = split_layers(n_layers, devices, "layers")
    if stages_per_rank(schedule) == 1:
        return keys, stage_layers, tuple(range(len(keys)))
    if isinstance(devices, dict):
        raise ValueError(f"schedule={schedule!r} places {stages_per_rank(schedule)} stages on each device "
                         f"itself: give a list of devices, not a device map")
    placement = make_schedule(schedule, len(keys), 2 * len(keys)).placement  # an m every schedule accepts (DualPipeV: m >= 2p)
    _, stage_layers = split_layers(n_layers, [keys[r] for r in placement], "layers")
    return keys, stage_layers, placement


def sum_tied_gradients(pairs: Sequence[tuple[nn.Parameter, nn.Parameter]], before: list[Optional[Tensor]]) -> None:
    """Give both copies of a tied weight the sum of this step's gradients of each."""
    for (a, b), a_before in zip(pairs, before):
        if a.grad is None or b.grad is None:
            continue
        # the pair held equal gradients before this step, so what each gained is its own
        # contribution this step; each copy adds the other's
        gained_a = a.grad - a_before if a_before is not None else a.grad.clone()
        gained_b = b.grad - a_before.to(b.device) if a_before is not None else b.grad.clone()
        a.grad += gained_b.to(a.device)
        b.grad += gained_a.to(b.device)
