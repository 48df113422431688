"""``Pipe``: run an ``nn.Sequential`` as a pipeline of stages on worker threads.

The executor follows a :class:`~parallel_lib.pipeline_parallel.schedule.Schedule` and
nothing else: each stage's actions go to that stage's worker thread in the
schedule's order, each as soon as its input exists (the previous stage's forward
output, the next stage's input gradient). There is no per-tick barrier, so a slow
backward on one stage does not hold every other stage back.

Backward is pipelined too. For CPU tensors PyTorch's autograd runs the whole
backward pass on the thread that calls it, so one ``loss.backward()`` over all
stages would run them one after another. Instead stages are cut apart in the
autograd graph: stage j receives its input detached, with ``requires_grad``, and
keeps its input and output. Its backward for micro-batch i is then a task of its
own, ``torch.autograd.backward(output, grad_of_output)``, which leaves the input's
gradient in ``input.grad`` for stage j-1. Stages' backwards overlap like their
forwards, on CPU as on GPUs::

    stage j-1                      stage j
    y = f(x) --- y.detach() ---->  x' (requires_grad) -> z = g(x')
    backward(y, x'.grad) <--- x'.grad ---- backward(z, grad_z)
"""

from __future__ import annotations

import weakref
from functools import partial
from queue import Empty
from typing import Any, Callable, Literal, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from parallel_lib.common.checks import check_choice, positive_int, positive_number
from parallel_lib.common.timeline import TimelineRecorder, synchronize_devices
from parallel_lib.model_parallel.device_map import DeviceMap
from parallel_lib.pipeline_parallel.microbatch import (
    Target,
    check_split,
    loss_weights,
    scatter,
    split_layers,
    split_like,
)
from parallel_lib.pipeline_parallel.schedule import SCHEDULES, Action, Schedule, action_ready, make_schedule
from parallel_lib.pipeline_parallel.worker import Task, Workers
from parallel_lib.runtime.device import DeviceKey, resolve_device

__all__ = ["Pipe", "StageError"]

LossFn = Callable[..., Tensor]
TiedPair = tuple[nn.Parameter, nn.Parameter]


class StageError(RuntimeError):
    """A stage raised while running an action; the original exception is the ``__cause__``.

    Attributes:
        stage: index of the failing stage.
        action: the failing action, e.g. ``B(2)``.
    """

    def __init__(self, stage: int, action: Action, error: BaseException) -> None:
        super().__init__(f"stage {stage} failed in {action} (micro-batch {action.micro_batch}): "
                         f"{type(error).__name__}: {error}")
        self.stage = stage
        self.action = action


class _Run:
    """One pass over the micro-batches: what stages hand each other and keep for backward."""

    def __init__(self, pipe: Pipe, inputs: list[Tensor], train: bool, loss_fn: Optional[LossFn] = None,
                 targets: Optional[list[Target]] = None, weights: Optional[list[float]] = None) -> None:
        self.partitions, self.devices = pipe.partitions, pipe.devices
        self.last = len(self.devices) - 1
        self.inputs, self.train, self.loss_fn = inputs, train, loss_fn
        self.targets, self.weights = targets, weights
        self.activations: dict[tuple[int, int], Tensor] = {}  # (j, i): stage j's output for i
        self.input_grads: dict[tuple[int, int], Tensor] = {}  # (j, i): gradient of stage j's input
        self.saved: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}  # (j, i): (input, output or loss)
        self.outputs: dict[int, Tensor] = {}  # i: last stage's output (forward pass)
        self.losses: dict[int, Tensor] = {}  # i: weighted loss of micro-batch i
        self.live = [0] * len(self.devices)  # micro-batches whose activations a stage holds now
        self.peak = [0] * len(self.devices)

    def compute(self, j: int, action: Action) -> Callable[[], Any]:
        """The closure a worker runs for ``action`` on stage j (inputs taken out of the run)."""
        i = action.micro_batch
        partition, device = self.partitions[j], self.devices[j]
        if action.kind == "B":
            x, y = self.saved.pop((j, i))
            grad_y = None if j == self.last else self.input_grads.pop((j + 1, i))

            def backward() -> Optional[Tensor]:
                if y.requires_grad:  # a parameter-free first stage has nothing to differentiate
                    torch.autograd.backward(y, None if grad_y is None else grad_y.to(y.device))
                return x.grad if j > 0 else None
            return backward

        x_from = self.inputs[i] if j == 0 else self.activations.pop((j - 1, i))

        def forward() -> Any:
            x = x_from.to(device)  # the hand-over between devices happens on the receiving stage
            if not self.train:
                return partition(x)
            if j > 0:  # cut the graph here so this stage's backward is a task of its own
                x = x.detach().requires_grad_(x.is_floating_point())
            y = partition(x)
            if j < self.last:
                return (x, y), y.detach()
            target = self.targets[i]  # type: ignore[index]
            targets = [target] if isinstance(target, Tensor) else list(target)
            loss = self.loss_fn(y, *(t.to(device) for t in targets)) * self.weights[i]  # type: ignore[misc,index]
            return (x, loss), loss.detach()
        return forward

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


class Pipe(nn.Module):
    """Pipeline parallelism for an ``nn.Sequential``, one worker thread per stage.

    Layers are grouped into contiguous stages by a device map; each call splits the
    batch into micro-batches and runs them through the stages following the chosen
    schedule. ``pipe(x)`` is a forward pass (outputs concatenated in order; with
    grad enabled they stay connected to the stages' graphs, so ``.backward()``
    works, unpipelined). :meth:`train_step` runs forward and a pipelined backward.

    Args:
        module: the layers, in order; each takes and returns one tensor.
        devices: one device key per stage, layers balanced as by
            :func:`~parallel_lib.model_parallel.device_map.get_device_map` (``[0, 1]``: GPUs 0 and 1, or the
            CPU on a machine without GPUs, see :func:`~parallel_lib.model_parallel.device_map.resolve_device`;
            ``["cpu", "cpu"]`` and :func:`parallel_lib.runtime.device` lists work too); or a
            device map ``{device: [layer indices]}`` for an explicit split.
        chunks: number of micro-batches (default 1); give this or ``split_size``.
        split_size: rows per micro-batch instead of ``chunks``.
        schedule: "gpipe" or "1f1b" (what :meth:`train_step` runs; forward passes are the same).
        num_threads: ``torch.set_num_threads`` in each worker thread.
        timeout: seconds to wait for any task to finish before raising ``TimeoutError``.
        tied_parameters: pairs of parameters that are one weight in the original model
            but live on two stages (GPT-2's embedding and LM head); after each
            :meth:`train_step` both hold the sum of their gradients, as Megatron-LM
            all-reduces embedding gradients. Default: ``module.tied_parameters`` if present.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``, or a device key of the wrong type.
        ValueError: no devices, more stages than layers, a device map that does not cover
            the layers in order or leaves a stage empty, ``chunks``/``split_size`` below 1 or both
            given, an unknown schedule, ``num_threads`` or ``timeout`` not positive.
    """

    def __init__(self, module: nn.Sequential, devices: Union[Sequence[DeviceKey], DeviceMap],
                 chunks: Optional[int] = None, *, split_size: Optional[int] = None,
                 schedule: Literal["gpipe", "1f1b"] = "gpipe", num_threads: int = 1, timeout: float = 60.0,
                 tied_parameters: Optional[Sequence[TiedPair]] = None) -> None:
        super().__init__()
        if not isinstance(module, nn.Sequential):
            raise TypeError(f"module must be an nn.Sequential, got {type(module).__name__}")
        keys, self.stage_layers = split_layers(len(module), devices, "layers")
        if chunks is None and split_size is None:
            chunks = 1
        check_split(chunks, split_size)
        check_choice("schedule", schedule, sorted(SCHEDULES))
        positive_int("num_threads", num_threads)
        positive_number("timeout", timeout, hint="seconds")

        self.devices = [resolve_device(key) for key in keys]
        self.partitions = nn.ModuleList(nn.Sequential(*(module[k] for k in layers)).to(device)
                                        for layers, device in zip(self.stage_layers, self.devices))
        self.chunks, self.split_size, self.schedule = chunks, split_size, schedule
        self.timeout = float(timeout)
        self.tied_parameters = list(tied_parameters if tied_parameters is not None
                                    else getattr(module, "tied_parameters", ()))
        cuda = any(d.type == "cuda" for d in self.devices)
        sync = partial(synchronize_devices, self.devices) if cuda else None  # every stage's GPU, not the current one
        self.timeline = TimelineRecorder(synchronize=sync)  # events of the last call
        self.peak_activations: list[int] = []  # per stage, in the last train_step
        self._workers = Workers(self.devices, num_threads)
        # stop the threads when the Pipe is garbage-collected or the interpreter exits
        self._finalizer = weakref.finalize(self, self._workers.close)

    @property
    def num_stages(self) -> int:
        return len(self.partitions)

    def close(self) -> None:
        """Stop the worker threads (the next call starts new ones)."""
        self._workers.close()

    def __enter__(self) -> Pipe:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def make_schedule(self, num_micro_batches: int) -> Schedule:
        """The schedule this pipe runs for a given number of micro-batches."""
        return make_schedule(self.schedule, self.num_stages, num_micro_batches)

    def forward(self, batch: Tensor) -> Tensor:
        """Run the micro-batches of ``batch`` through the stages; outputs concatenated on the last device."""
        inputs = scatter(batch, self.chunks, self.split_size)
        run = _Run(self, inputs, train=False)
        self._execute(run, self.make_schedule(len(inputs)).forward_only(), torch.is_grad_enabled())
        return torch.cat([run.outputs[i] for i in range(len(inputs))])

    def train_step(self, batch: Tensor, target: Target, loss_fn: LossFn,
                   reduction: Literal["mean", "sum"] = "mean") -> Tensor:
        """Forward and pipelined backward of one batch; gradients accumulate in ``.grad``.

        The result equals ``loss_fn(module(batch), target)`` followed by ``.backward()``
        on the unsplit module: each micro-batch's loss is weighted by its share of the
        rows (``reduction="mean"``, for a ``loss_fn`` that averages over rows, or over
        tokens when every row has the same number) or by 1 (``reduction="sum"``).

        Args:
            batch: the input of the first stage, split along dim 0.
            target: a tensor, or tuple of tensors, with the batch's rows; split alike.
            loss_fn: ``loss_fn(last_stage_output, *target_micro_batch) -> scalar``, e.g.
                ``mse_loss`` for one target tensor, or ``partial(weighted_cross_entropy,
                denominator=total_weight)`` for ``target=(labels, weights)``.
            reduction: how ``loss_fn`` reduces over rows.

        Returns:
            The full-batch loss (detached), on the last stage's device.

        Raises:
            StageError: a stage raised (the original exception and traceback are its cause).
            TimeoutError: no stage finished a task within ``timeout`` seconds.
            ValueError: a batch with fewer rows than ``chunks``, or a target whose rows differ.
        """
        inputs = scatter(batch, self.chunks, self.split_size)
        sizes = [x.size(0) for x in inputs]
        run = _Run(self, inputs, train=True, loss_fn=loss_fn, targets=split_like(target, sizes),
                   weights=loss_weights(sizes, reduction))
        before = [(a.grad.clone() if a.grad is not None else None) for a, _ in self.tied_parameters]
        self._execute(run, self.make_schedule(len(inputs)), True)
        self.peak_activations = run.peak
        self._sum_tied_gradients(before)
        return torch.stack([run.losses[i] for i in range(len(inputs))]).sum()

    def _sum_tied_gradients(self, before: list[Optional[Tensor]]) -> None:
        """Give both copies of a tied weight the sum of this step's gradients of each."""
        for (a, b), a_before in zip(self.tied_parameters, before):
            if a.grad is None or b.grad is None:
                continue
            # the pair held equal gradients before this step, so what each gained is its own
            # contribution this step; each copy adds the other's
            gained_a = a.grad - a_before if a_before is not None else a.grad.clone()
            gained_b = b.grad - a_before.to(b.device) if a_before is not None else b.grad.clone()
            a.grad += gained_b.to(a.device)
            b.grad += gained_a.to(b.device)

    def _execute(self, run: _Run, schedule: Schedule, grad_mode: bool) -> None:
        """Submit every stage's actions in schedule order as their inputs arrive; collect results."""
        self.timeline.reset()
        self._workers.start()
        p = schedule.num_stages
        position = [0] * p
        done: set[tuple[str, int, int]] = set()
        in_flight: dict[int, list[Action]] = {j: [] for j in range(p)}
        failure: Optional[tuple[Task, Any]] = None
        try:
            while True:
                for j in range(p if failure is None else 0):  # after a failure: only drain
                    actions = schedule.stages[j]
                    while position[j] < len(actions) and action_ready(schedule, j, actions[position[j]], done):
                        action = actions[position[j]]
                        position[j] += 1
                        self._workers.submit(Task(j, action, run.compute(j, action), grad_mode, self.timeline))
                        in_flight[j].append(action)
                if not any(in_flight.values()):
                    break
                try:
                    task, ok, payload = self._workers.answer(timeout=self.timeout)
                except Empty:
                    waiting = {f"stage {j}": " ".join(map(str, a)) for j, a in in_flight.items() if a}
                    raise TimeoutError(f"no stage finished a task within timeout={self.timeout:g} s; "
                                       f"running or queued: {waiting}") from None
                in_flight[task.stage].remove(task.action)
                if not ok:
                    failure = failure or (task, payload)
                elif failure is None:
                    run.finish(task.stage, task.action, payload)
                    done.add((task.action.kind, task.stage, task.action.micro_batch))
        except BaseException:  # timeout, KeyboardInterrupt, a bug here: leave no thread behind
            self._workers.close(timeout=1.0)
            raise
        if failure is not None:
            self._workers.close()
            task, (_, error, traceback) = failure
            raise StageError(task.stage, task.action, error) from error.with_traceback(traceback)
        unfinished = [j for j in range(p) if position[j] < len(schedule.stages[j])]
        if unfinished:  # validate_schedule rules this out for the generated schedules
            raise RuntimeError(f"schedule {schedule.name!r} stalled on stages {unfinished}")
