"""When each device of a model-parallel model works: forward and backward timelines.

:func:`record_timeline` hooks each placed part (forward hooks for the forward pass,
autograd hooks for the backward pass) and records one timeline event per part and
pass, so chapter 03 can show that only one device works at a time. On GPUs each bar is
measured by CUDA events recorded on its own device's stream (per-device busy intervals of
the real run, nothing synchronised in between); on CPUs by the host clock.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
from torch import nn

from parallel_lib.common.models import build_gpt2
from parallel_lib.common.timeline import Event, Stamp, TimelineRecorder, makespan
from parallel_lib.model_parallel.device_map import DeviceMap, get_device_map, lane_name
from parallel_lib.model_parallel.placing import parallelize, placement
from parallel_lib.runtime.device import resolve_device

__all__ = ["record_timeline", "measure_step_timeline"]


def _first_tensor(obj: Any) -> Optional[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (tuple, list)):
        return next((t for t in map(_first_tensor, obj) if t is not None), None)
    return None


def _time_backward(recorder: TimelineRecorder, lane: str, device: torch.device, name: str, micro_batch: int,
                   output: torch.Tensor, grad_of: torch.Tensor) -> None:
    """Record a backward event from "the node that made ``output`` starts" to "the grad of ``grad_of`` is ready".

    A node pre-hook fires after the tensor hooks of that node's output, so when one
    part's input *is* the previous part's output (same device), the later part's
    backward ends before the earlier part's begins: hand-overs never overlap.
    """
    started: list[Stamp] = []

    def node_starts(grad_outputs: tuple) -> None:
        started.append(recorder.stamp(device))

    def grad_ready(grad: torch.Tensor) -> None:
        if started:
            recorder.add_stamped(lane, "backward", micro_batch, started.pop(), recorder.stamp(device), name)

    assert output.grad_fn is not None
    output.grad_fn.register_prehook(node_starts)
    grad_of.register_hook(grad_ready)


def _instrument(recorder: TimelineRecorder, module: nn.Module, lane: str, device: torch.device, name: str,
                state: dict) -> list:
    """Hooks that record ``module``'s forward and, through autograd hooks, its backward, on ``device``."""
    started: list[Stamp] = []

    def before(mod: nn.Module, args: tuple) -> None:
        started.append(recorder.stamp(device))  # after parallelize's own pre-hook moved the inputs here

    def after(mod: nn.Module, args: tuple, output: Any) -> None:
        state["end"] = recorder.stamp(device)
        recorder.add_stamped(lane, "forward", state["step"], started.pop(), state["end"], name)
        x, y = _first_tensor(args), _first_tensor(output)
        if x is not None and y is not None and x.requires_grad and y.grad_fn is not None:
            _time_backward(recorder, lane, device, name, state["step"], y, x)
        # else: no grad mode, or token ids in: no backward boundary to time

    return [module.register_forward_pre_hook(before), module.register_forward_hook(after)]


@contextmanager
def record_timeline(model: nn.Module, device_map: Optional[DeviceMap] = None) -> Iterator[list[Event]]:
    """Record each placed part's forward and backward as timeline events.

    One lane per device key (:func:`lane_name`), one event per part and pass, labelled
    with the part's name (``"h3"``); ``micro_batch`` counts the model's forward calls
    from 0. A loss the model computes itself (``labels=``) appears as a "loss" part
    on the lane of the last part (the LM head's). The embeddings' backward is not drawn:
    their input is token ids, which have no gradient to time.

    A bar must show when a device *ran* its kernels, not when the host queued them. On CUDA
    devices each stamp is a CUDA event recorded on that part's device's current stream:
    the devices run as they would untimed (nothing synchronises them between parts), and
    the events are read once, when the ``with`` block ends. CPU parts read the host clock.

    Args:
        model: as for :func:`placement`.
        device_map: lanes to use; default ``model.device_map`` (or one device).

    Yields:
        The list of :class:`~parallel_lib.common.timeline.Event`; it fills as the model runs
        on CPUs, and with the CUDA parts' events when the ``with`` block ends.
    """
    owners = placement(model, device_map)
    where = {key: resolve_device(key) for key, _, _ in owners}
    cuda = sorted({d for d in where.values() if d.type == "cuda"}, key=str)
    recorder = TimelineRecorder(event_devices=cuda)
    state: dict[str, Any] = {"step": -1, "end": 0.0}  # forward calls so far; when the last part finished
    output_key = owners[-1][0]
    output_lane, output_device = lane_name(output_key), where[output_key]

    def begin(mod: nn.Module, args: tuple) -> None:
        state["step"] += 1

    def finish(mod: nn.Module, args: tuple, output: Any) -> None:
        loss, logits = getattr(output, "loss", None), getattr(output, "logits", None)
        if isinstance(loss, torch.Tensor):  # computed inside forward, after the last part
            recorder.add_stamped(output_lane, "forward", state["step"], state["end"], recorder.stamp(output_device),
                                 "loss")
            if loss.grad_fn is not None and isinstance(logits, torch.Tensor) and logits.requires_grad:
                _time_backward(recorder, output_lane, output_device, "loss", state["step"], loss, logits)

    handles = [model.register_forward_pre_hook(begin), model.register_forward_hook(finish)]
    for key, name, module in owners:
        handles += _instrument(recorder, module, lane_name(key), where[key], name, state)
    try:
        yield recorder.events
    finally:
        for handle in handles:
            handle.remove()
        recorder.resolve()  # CUDA parts' events, read once the devices have run them


def measure_step_timeline(device_map: Optional[DeviceMap] = None, batch_size: int = 8, seq_len: int = 64,
                          steps: int = 5) -> list[Event]:
    """Record forward + backward steps of the tiny GPT-2 split by ``device_map``; return the fastest.

    Of ``steps`` recorded steps the one with the shortest makespan is returned: the step
    least disturbed by other programs on the machine. The lanes are the map's keys.

    Args:
        device_map: default: the 4 blocks over 4 devices, or over every GPU when there are 1 to 3
            (int keys must name GPUs that exist, see :func:`~parallel_lib.runtime.device.resolve_device`).
        batch_size: rows per step.
        seq_len: tokens per row.
        steps: steps to record (after one warm-up step).
    """
    if device_map is None:
        device_map = get_device_map(4, list(range(min(torch.cuda.device_count(), 4) or 4)))
    model = parallelize(build_gpt2("tiny", vocab_size=1024), device_map)
    ids = torch.randint(0, 1024, (batch_size, seq_len), generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is as fast, and spared oversubscribed cores' stalls
    try:
        model(input_ids=ids, labels=ids).loss.backward()  # warm-up: the first pass allocates
        with record_timeline(model) as events:
            for _ in range(steps):
                model(input_ids=ids, labels=ids).loss.backward()
    finally:
        torch.set_num_threads(threads)
    by_step = [[e for e in events if e.micro_batch == step] for step in range(steps)]
    return min(by_step, key=makespan)
