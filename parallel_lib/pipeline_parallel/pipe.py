"""``Pipe``: run an ``nn.Sequential`` as a pipeline of stages on worker threads.

The executor follows a :class:`~parallel_lib.pipeline_parallel.schedule.Schedule` and
nothing else: each rank's worker thread runs that rank's actions in the schedule's order
with :func:`~parallel_lib.pipeline_parallel.runtime.run_actions`, the loop the ranks of
chapters 05, 08 and 10 run over processes; here the hand-overs are Python objects in a
mailbox (:class:`~parallel_lib.pipeline_parallel.transports.ThreadLink`), and an action starts
as soon as its input is there (the previous stage's forward output, the next stage's input
gradient). There is no per-tick barrier, so a slow backward on one stage does not hold every
other stage back. Each action reports back to the caller's thread as it ends, which is what
the timeout watches.

Backward is pipelined too: every stage is cut out of the autograd graph at its input
by a :class:`~parallel_lib.pipeline_parallel.stage.StageRunner` (the one the ranks of
chapter 05 use), so stage j's backward for micro-batch i is a task of its own and
stages' backwards overlap like their forwards, on CPU as on GPUs::

    stage j-1                      stage j
    y = f(x) --- y.detach() ---->  x' (requires_grad) -> z = g(x')
    backward(y, x'.grad) <--- x'.grad ---- backward(z, grad_z)

A failed call (a stage raised, a timeout, a ``KeyboardInterrupt`` in the caller) drops the
work still queued. After an interrupt it waits for the tasks already running (up to
``timeout``); a task still running after that, or after a timeout, is a leftover thread,
and the Pipe refuses to run until it has ended (it may still write gradients). ``.grad``
then holds part of the failed step's gradients: zero them before the next step.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from functools import partial
from queue import Empty
from typing import Any, Callable, Literal, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from parallel_lib.common.checks import check_choice, positive_int, positive_number
from parallel_lib.common.timeline import TimelineRecorder
from parallel_lib.model_parallel.device_map import DeviceMap
from parallel_lib.pipeline_parallel.microbatch import (
    Target,
    check_layers,
    check_split,
    gather,
    loss_weights,
    scatter,
    split_like,
)
from parallel_lib.pipeline_parallel.run import CHECKPOINTS, Checkpoint, LossFn, StageError, layout, sum_tied_gradients
from parallel_lib.pipeline_parallel.runtime import RankStages, run_actions
from parallel_lib.pipeline_parallel.schedule import ALL_SCHEDULES, Action, Schedule, make_schedule
from parallel_lib.pipeline_parallel.simulator import _label, validate_schedule
from parallel_lib.pipeline_parallel.stage import StageRunner, TensorOrTensors
from parallel_lib.pipeline_parallel.transports import Cancelled, Mailbox, ThreadLink
from parallel_lib.pipeline_parallel.worker import Task, Workers
from parallel_lib.runtime.device import DeviceKey, resolve_device

__all__ = ["Pipe", "StageError"]

TiedPair = tuple[nn.Parameter, nn.Parameter]
_MOVING_DENIED = ("a Pipe places its stages itself and moving it would leave its devices inconsistent: "
                  "choose the devices when making it, e.g. Pipe(module, devices=[0, 1])")


def _generator(device: torch.device) -> str:
    """The random-number generator a stage on ``device`` draws from ("cuda" is GPU 0 in a stage's thread)."""
    return "cpu" if device.type == "cpu" else f"{device.type}:{device.index or 0}"


def _accepts(name: str, p: int, m: int) -> bool:
    try:
        make_schedule(name, p, m)
    except ValueError:
        return False
    return True


class Pipe(nn.Module):
    """Pipeline parallelism for an ``nn.Sequential``, one worker thread per stage.

    Layers are grouped into contiguous stages by a device map; each call splits the
    batch into micro-batches and runs them through the stages following the chosen
    schedule. ``pipe(x)`` is a forward pass (outputs concatenated in order; with
    grad enabled they stay connected to the stages' graphs, so ``.backward()``
    works, unpipelined). :meth:`train_step` runs forward and a pipelined backward.

    Hooks: the Pipe calls each partition (``pipe.partitions[s]``) as a module on every route, so
    forward (pre-)hooks registered on a partition or on its layers fire once per micro-batch,
    and once more for a micro-batch whose forward is recomputed (as in torchgpipe).

    Args:
        module: the layers, in order; each takes and returns a tensor or a tuple of tensors
            (the batch may be a tuple too, e.g. hidden states and a mask). No layer or
            parameter may appear twice. The Pipe registers the layers under their names in
            ``module``, so its ``state_dict`` loads into the plain model and back.
        devices: one device key per stage, layers balanced as by
            :func:`~parallel_lib.model_parallel.device_map.get_device_map` (``[0, 1]``: GPUs 0 and 1, or the
            CPU on a machine without GPUs, see :func:`~parallel_lib.model_parallel.device_map.resolve_device`;
            ``["cpu", "cpu"]`` and :func:`parallel_lib.runtime.device` lists work too); or a
            device map ``{device: [layer indices]}`` for an explicit split.
        chunks: number of micro-batches (default 1); give this or ``split_size``.
        split_size: rows per micro-batch instead of ``chunks``.
        schedule: what :meth:`train_step` runs (forward passes are the same): "gpipe", "1f1b",
            "zb-h1", "zb-h2" (backward split into B and W), or "interleaved", "zbv" and "dualpipev",
            which cut the layers into 2 stages per device (interleaved: stage s on device s % p; the others a V);
            or a hand-written :class:`~parallel_lib.pipeline_parallel.schedule.Schedule` (one rank per device,
            its ``placement`` for where the model stages live), which then runs its own number of micro-batches.
        checkpoint: activation recomputation, as torchgpipe offers it: "never", "except_last"
            (every micro-batch but the last keeps only its input and runs its forward again at
            backward time) or "always". In :meth:`train_step` the recomputation runs in the
            stage's pipelined backward; after ``pipe(x)`` with grad on, in autograd's backward of
            the output (``torch.utils.checkpoint``). Either way it replays the random-number state
            the forward started from (the CPU generator's and the stage's GPU's), so dropout
            draws the same masks and the gradients belong to the forward whose loss was
            returned; to make that exact, stages that share a generator (several CPU stages,
            two stages on one GPU) run their forwards one at a time when ``checkpoint`` is not
            "never". The recomputation runs every layer's forward twice: an in-place operation
            that is not safe to repeat on a tensor without gradient (``mask.add_(1)`` on an
            input) runs twice too, and the gradients then follow the second run (as in
            torchgpipe: in :meth:`train_step` the gradient of ``x * w * mask`` after
            ``mask.add_(1)`` is 3 instead of 2; after ``pipe(x)``, ``backward`` raises
            "modified by an inplace operation"); keep such operations out of a checkpointed
            Pipe, or make them out of place.
        num_threads: ``torch.set_num_threads`` in each worker thread.
        timeout: seconds to wait for any task to finish before raising ``TimeoutError``.
        tied_parameters: pairs of parameters that are one weight in the original model
            but live on two stages (GPT-2's embedding and LM head); after each
            :meth:`train_step` both hold the sum of their gradients, as Megatron-LM
            all-reduces embedding gradients. Default: ``module.tied_parameters`` if present.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``, ``devices`` a single key instead of a
            list, or a device key of the wrong type.
        ValueError: a layer or parameter held twice, no devices, more stages than layers, a device
            map that does not cover the layers in order or leaves a stage empty, ``chunks``/``split_size``
            below 1 or both given, an unknown schedule or a hand-written one the validator refuses,
            ``num_threads`` or ``timeout`` not positive.
    """

    def __init__(self, module: nn.Sequential, devices: Union[Sequence[DeviceKey], DeviceMap],
                 chunks: Optional[int] = None, *, split_size: Optional[int] = None,
                 schedule: Union[str, Schedule] = "gpipe", num_threads: int = 1, timeout: float = 60.0,
                 tied_parameters: Optional[Sequence[TiedPair]] = None, checkpoint: Checkpoint = "never") -> None:
        super().__init__()
        if not isinstance(module, nn.Sequential):
            raise TypeError(f"module must be an nn.Sequential, got {type(module).__name__}")
        check_layers(module)
        make_schedule("gpipe", 1, 1)  # registers every schedule's name
        if isinstance(schedule, Schedule):
            validate_schedule(schedule)  # a hand-written one is refused with its reason before a thread starts
        else:
            check_choice("schedule", schedule, sorted(ALL_SCHEDULES))
        check_choice("checkpoint", checkpoint, CHECKPOINTS)
        keys, self.stage_layers, self.placement = layout(len(module), devices, schedule)
        if chunks is None and split_size is None:
            chunks = 1
        check_split(chunks, split_size)
        positive_int("num_threads", num_threads)
        positive_number("timeout", timeout, hint="seconds")

        self.devices = [resolve_device(key) for key in keys]  # one per rank (worker thread)
        stage_devices = [self.devices[r] for r in self.placement]
        names = list(module._modules)
        # a plain list, not a ModuleList: the layers are registered once, below, under their own names
        self.partitions = [nn.Sequential(OrderedDict((names[k], module[k].to(device)) for k in layers))
                           for layers, device in zip(self.stage_layers, stage_devices)]
        self.runners = [StageRunner(part, device, first=s == 0)
                        for s, (part, device) in enumerate(zip(self.partitions, stage_devices))]
        self.chunks, self.split_size, self.schedule = chunks, split_size, schedule
        self.checkpoint = checkpoint
        self._rng_locks = {_generator(device): threading.Lock() for device in stage_devices}
        self.timeout = float(timeout)
        self.tied_parameters = list(tied_parameters if tied_parameters is not None
                                    else getattr(module, "tied_parameters", ()))
        # GPU stages are timed by CUDA events on their own streams (worker.Task), read after the call
        self.timeline = TimelineRecorder(event_devices=self.devices)  # events of the last call
        self.peak_activations: list[int] = []  # per rank, in the last train_step (stage-activations)
        self.peak_activation_bytes: list[int] = []  # per rank: what autograd saved for backward, at its peak
        self._workers = Workers(self.devices, num_threads)
        # stop the threads when the Pipe is garbage-collected or the interpreter exits
        self._finalizer = weakref.finalize(self, self._workers.close)
        for name in names:  # state_dict keys are the plain model's, so a trained Pipe loads back into it
            if hasattr(self, name):
                raise ValueError(f"module's layer {name!r} has the name of a Pipe attribute; rename it")
            self.add_module(name, module._modules[name])

    def to(self, *args: Any, **kwargs: Any) -> Pipe:
        """Only a dtype change (``pipe.to(torch.float64)``): the Pipe owns its stages' devices.

        Raises:
            TypeError: a device (or a tensor, whose device it would take) is given.
        """
        # refused before parsing: parsing a GPU index on a machine without one raises its own error
        moving = any(not isinstance(a, (torch.dtype, bool)) for a in args) or {"device", "tensor"} & set(kwargs)
        if moving or torch._C._nn._parse_to(*args, **kwargs)[0] is not None:
            raise TypeError(_MOVING_DENIED)
        return super().to(*args, **kwargs)

    def cuda(self, device: Any = None) -> Pipe:
        """Refused: the Pipe owns its stages' devices (``TypeError``)."""
        raise TypeError(_MOVING_DENIED)

    def cpu(self) -> Pipe:
        """Refused: the Pipe owns its stages' devices (``TypeError``)."""
        raise TypeError(_MOVING_DENIED)

    @property
    def num_stages(self) -> int:
        """p: the number of ranks (worker threads); ``len(self.partitions)`` model stages are v times that."""
        return len(self.devices)

    def close(self) -> None:
        """Stop the worker threads (the next call starts new ones)."""
        self._workers.close()

    def __enter__(self) -> Pipe:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def make_schedule(self, num_micro_batches: int) -> Schedule:
        """The schedule this pipe runs for a given number of micro-batches.

        Raises:
            ValueError: the named schedule cannot run that many, or a hand-written one is for another number.
        """
        if isinstance(self.schedule, Schedule):
            if num_micro_batches != self.schedule.num_micro_batches:
                raise ValueError(f"schedule {self.schedule.name!r} is written for "
                                 f"{self.schedule.num_micro_batches} micro-batches, got {num_micro_batches}")
            return self.schedule
        return make_schedule(self.schedule, self.num_stages, num_micro_batches)

    def _schedule_for(self, inputs: list[TensorOrTensors], batch: TensorOrTensors) -> Schedule:
        """The schedule for a batch split into ``inputs``, or an error in the caller's terms (rows, chunks).

        Raises:
            ValueError: the schedule cannot run the micro-batches the batch splits into.
        """
        try:
            return self.make_schedule(len(inputs))
        except ValueError as error:
            if isinstance(self.schedule, Schedule):
                raise ValueError(f"{error}: give chunks={self.schedule.num_micro_batches} and a batch of at least "
                                 f"that many rows") from None
            m, rows = len(inputs), (batch if isinstance(batch, Tensor) else batch[0]).size(0)
            runs = [k for k in range(m + 1, m + 4 * self.num_stages + 1) if _accepts(self.schedule, self.num_stages, k)]
            head = (f"schedule={self.schedule!r} on {self.num_stages} devices cannot run {m} micro-batches"
                    + (f" (the next number it runs is {runs[0]})" if runs else ""))
            if self.chunks is not None and rows < self.chunks:
                raise ValueError(f"{head}: the batch's {rows} rows split into only {m} micro-batches of one row, "
                                 f"not chunks={self.chunks}; give a batch of at least {self.chunks} rows") from None
            asked = f"chunks={self.chunks}" if self.chunks is not None else f"split_size={self.split_size}"
            raise ValueError(f"{head}: the batch of {rows} rows splits into {m} with {asked}; choose chunks "
                             f"(or split_size) so that it splits into a number the schedule runs") from None

    def forward(self, batch: TensorOrTensors) -> TensorOrTensors:
        """Run the micro-batches of ``batch`` through the stages; outputs concatenated on the last device."""
        inputs = scatter(batch, self.chunks, self.split_size)
        schedule = self._schedule_for(inputs, batch).forward_only()
        ranks = self._execute(schedule, torch.is_grad_enabled(), inputs=inputs, train=False)  # recomputes with grad on
        outputs = ranks[self.placement[-1]].outputs
        return gather([outputs[i] for i in range(len(inputs))])

    def train_step(self, batch: TensorOrTensors, target: Target, loss_fn: LossFn,
                   reduction: Literal["mean", "sum"] = "mean") -> Tensor:
        """Forward and pipelined backward of one batch; gradients accumulate in ``.grad``.

        The result equals ``loss_fn(module(batch), target)`` followed by ``.backward()``
        on the unsplit module: each micro-batch's loss is weighted by its share of the
        rows (``reduction="mean"``, for a ``loss_fn`` that averages over rows) or by 1
        (``reduction="sum"``, for a ``loss_fn`` that sums, or that divides by a whole-batch
        total such as the batch's number of target tokens).

        Args:
            batch: the input of the first stage (a tensor or tuple of tensors), split along dim 0;
                a batch with fewer rows than ``chunks`` runs with one micro-batch per row.
            target: a tensor, or tuple of tensors, with the batch's rows; split alike.
            loss_fn: ``loss_fn(last_stage_output, *target_micro_batch) -> scalar``, e.g.
                ``mse_loss`` for one target tensor, or ``partial(weighted_cross_entropy,
                denominator=total_weight)`` with ``reduction="sum"`` for ``target=(labels, weights)``.
            reduction: how ``loss_fn`` reduces over rows.

        Returns:
            The full-batch loss (detached), on the last stage's device.

        Raises:
            StageError: a stage raised (the original exception and traceback are its cause).
            TimeoutError: no stage finished a task within ``timeout`` seconds.
            RuntimeError: a stage thread of an earlier, failed call is still running.
            ValueError: a target whose rows differ, or ``reduction="mean"`` with a tuple target.
        """
        if reduction == "mean" and not isinstance(target, Tensor):
            # a token mean is not a row mean when rows hold different numbers of tokens
            # (weights of (labels, weights)): row-share weighting would be off, silently
            raise ValueError('reduction="mean" with a tuple target: a Pipe weights each micro-batch\'s loss by '
                             "its share of the rows, which is wrong for a loss averaged over weighted tokens; "
                             "divide by the whole batch's total in loss_fn, e.g. functools.partial("
                             "weighted_cross_entropy, denominator=weights.sum()), and pass reduction=\"sum\"")
        inputs = scatter(batch, self.chunks, self.split_size)
        sizes = [(x if isinstance(x, Tensor) else x[0]).size(0) for x in inputs]
        targets, weights = split_like(target, sizes), loss_weights(sizes, reduction)
        device = self.runners[-1].device

        def loss(i: int) -> Callable[[TensorOrTensors], Tensor]:  # micro-batch i's weighted loss, on the last device
            mine = [targets[i]] if isinstance(targets[i], Tensor) else list(targets[i])  # type: ignore[arg-type]
            return lambda y: loss_fn(y, *(t.to(device) for t in mine)) * weights[i]

        m = len(inputs)
        before = [(a.grad.clone() if a.grad is not None else None) for a, _ in self.tied_parameters]
        ranks = self._execute(self._schedule_for(inputs, batch), True, inputs=inputs, loss=loss)
        self.peak_activations = [r.peak for r in ranks]
        self.peak_activation_bytes = [r.peak_bytes for r in ranks]
        sum_tied_gradients(self.tied_parameters, before)
        losses = ranks[self.placement[-1]].losses
        return torch.stack([losses[i] for i in range(m)]).sum()

    def _execute(self, schedule: Schedule, grad_mode: bool, **step: Any) -> list[RankStages]:
        """Run every rank's actions on its worker thread (``run_actions`` over a :class:`ThreadLink`).

        ``step`` goes to each rank's :class:`RankStages` (inputs, loss, train), with which micro-batches
        recompute (``checkpoint``). Returns the ranks' stages, with their losses, outputs and memory peaks.
        """
        m = len(step["inputs"])
        step["recompute"] = lambda i: self.checkpoint == "always" or (self.checkpoint == "except_last" and i < m - 1)
        for runner in self.runners:  # recomputing: stages that share a generator draw from it in turn
            runner.rng_lock = self._rng_locks[_generator(runner.device)] if self.checkpoint != "never" else None
        self.timeline.reset()
        self._workers.start()  # refuses while a task of a failed call still runs
        p = schedule.num_stages
        mailbox = Mailbox(self._workers.cancelled)
        ranks = [RankStages(schedule, j, {s: self.runners[s] for s, r in enumerate(self.placement) if r == j},
                            timed=partial(self._timed, schedule, j, grad_mode), **step) for j in range(p)]
        for j in range(p):
            self._workers.submit(Task(j, None, partial(run_actions, schedule, j, ranks[j],
                                                       ThreadLink(schedule, j, mailbox)), grad_mode))
        finished, ended = [0] * p, 0  # actions done per rank; ranks whose loop has returned
        failure: Optional[Any] = None
        try:
            while ended < p:
                try:
                    task, ok, payload = self._workers.answer(timeout=self.timeout)
                except Empty:
                    waiting = {f"stage {j}": " ".join(map(str, schedule.stages[j][finished[j]:]))
                               for j in range(p) if finished[j] < len(schedule.stages[j])}
                    raise TimeoutError(f"no stage finished a task within timeout={self.timeout:g} s; "
                                       f"running or queued: {waiting}") from None
                if task.action is not None:  # one action done
                    finished[task.stage] += 1
                    continue
                ended += 1
                if not ok and payload is not None and failure is None and not isinstance(payload[1], Cancelled):
                    failure = payload  # a StageError from the rank (or a bug in the loop itself)
                    self._workers.cancel()  # early stop: the other ranks stop at their next action or wait
        except BaseException as error:  # timeout, interrupt, a bug here: the ranks stop at their next action;
            # after an interrupt, wait (up to timeout; a second interrupt ends the wait) for running
            # actions, so a re-run right away is clean; one still running is a leftover (see Workers)
            self._workers.close(timeout=self.timeout if isinstance(error, KeyboardInterrupt) else 0.1)
            raise
        if failure is not None:
            self._workers.close()
            _, error, traceback = failure
            raise error.with_traceback(traceback)
        return ranks

    def _timed(self, schedule: Schedule, j: int, grad_mode: bool, action: Action, compute: Any) -> Any:
        """Run one action of rank j on its thread: timed on the timeline, reported done, a failure named."""
        task = Task(j, action, compute, grad_mode, self.timeline, self.devices[j], _label(schedule, action))
        try:
            result = task.run()
        except BaseException as error:  # KeyboardInterrupt too: the caller reports it at once
            raise StageError(j, action, error) from error
        self._workers.report(task)
        return result
