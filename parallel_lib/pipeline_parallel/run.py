"""What one call of a :class:`~parallel_lib.pipeline_parallel.Pipe` hands between its stages.

:class:`PipelineRun` turns an action of the schedule into the closure a stage's worker runs
(:meth:`PipelineRun.compute`) and files the result where the next actions look for it
(:meth:`PipelineRun.finish`). The stage work itself is
:class:`~parallel_lib.pipeline_parallel.stage.StageRunner`'s.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional, Sequence

from torch import Tensor

from parallel_lib.pipeline_parallel.microbatch import Target
from parallel_lib.pipeline_parallel.schedule import Action
from parallel_lib.pipeline_parallel.stage import Saved, StageRunner, TensorOrTensors

__all__ = ["PipelineRun", "LossFn"]

LossFn = Callable[..., Tensor]


class PipelineRun:
    """One pass over the micro-batches: what stages hand each other and keep for backward."""

    def __init__(self, runners: Sequence[StageRunner], inputs: list[TensorOrTensors], train: bool,
                 loss_fn: Optional[LossFn] = None, targets: Optional[list[Target]] = None,
                 weights: Optional[list[float]] = None) -> None:
        self.runners = list(runners)
        self.last = len(self.runners) - 1
        self.inputs, self.train, self.loss_fn = inputs, train, loss_fn
        self.targets, self.weights = targets, weights
        self.activations: dict[tuple[int, int], TensorOrTensors] = {}  # (j, i): stage j's output for i
        self.input_grads: dict[tuple[int, int], TensorOrTensors] = {}  # (j, i): gradient of stage j's input
        self.saved: dict[tuple[int, int], Saved] = {}  # (j, i): (input, output or loss) for backward
        self.outputs: dict[int, TensorOrTensors] = {}  # i: last stage's output (forward pass)
        self.losses: dict[int, Tensor] = {}  # i: weighted loss of micro-batch i
        self.live = [0] * len(self.runners)  # micro-batches whose activations a stage holds now
        self.peak = [0] * len(self.runners)

    def compute(self, j: int, action: Action) -> Callable[[], Any]:
        """The closure a worker runs for ``action`` on stage j (inputs taken out of the run)."""
        i, runner = action.micro_batch, self.runners[j]
        if action.kind == "B":  # backward(z, grad_z); returns the gradient of the stage's input
            grad = None if j == self.last else self.input_grads.pop((j + 1, i))
            return partial(runner.backward, self.saved.pop((j, i)), grad)
        x = self.inputs[i] if j == 0 else self.activations.pop((j - 1, i))
        if not self.train:  # inference, or pipe(x) with grad on: the stages' graphs stay connected
            return partial(runner.run, x)
        return partial(runner.forward, x, self._loss(i) if j == self.last else None)

    def _loss(self, i: int) -> Callable[[TensorOrTensors], Tensor]:
        """Micro-batch i's weighted loss, computed on the last stage's device."""
        target = self.targets[i]  # type: ignore[index]
        targets = [target] if isinstance(target, Tensor) else list(target)
        device = self.runners[self.last].device
        return lambda y: self.loss_fn(y, *(t.to(device) for t in targets)) * self.weights[i]  # type: ignore

    def finish(self, j: int, action: Action, result: Any) -> None:
        """Store what ``action`` on stage j produced where the next actions will look for it."""
        i = action.micro_batch
        if action.kind == "B":
            self.live[j] -= 1
            if j > 0:
                self.input_grads[(j, i)] = result
            return
        if self.train:
            self.saved[(j, i)], result = result
            self.live[j] += 1
            self.peak[j] = max(self.peak[j], self.live[j])
        if j < self.last:
            self.activations[(j, i)] = result
        elif self.train:
            self.losses[i] = result
        else:
            self.outputs[i] = result
