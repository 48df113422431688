"""Naive model parallelism: run a model's consecutive blocks on different devices.

:func:`parallelize` places a Hugging Face GPT-2 according to a device map
(:mod:`parallel_lib.device_map`) and makes the hand-over between devices invisible
to the caller: forward pre-hooks move each part's inputs to that part's device,
and because ``Tensor.to`` is differentiable, autograd sends the gradients back the
same way. Nothing in ``transformers`` is patched, so the model's own ``forward``
(masks, loss, generation) runs unchanged — current ``transformers`` removed GPT-2's
``parallelize()``, and hooks are the least intrusive way to bring it back.

Only one device works at a time: block ``i + 1`` needs block ``i``'s output.
:func:`record_timeline` measures exactly that, and :func:`balance_by_time` /
:func:`balance_by_params` choose the cut that keeps the busiest device least busy.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from functools import partial
from typing import Any, Iterator, Optional, Sequence, Union

import torch
from torch import nn
from transformers import GPT2LMHeadModel, GPT2Model

from .device_map import (DeviceKey, DeviceMap, balance_by_cost, get_device_map, lane_name, resolve_device,
                         validate_device_map)
from .timeline import Event, TimelineRecorder, synchronize_devices

__all__ = [
    "placement",
    "parallelize",
    "parallelize_sequential",
    "deparallelize",
    "record_timeline",
    "balance_by_params",
    "balance_by_time",
]

# Where each part of the model runs. GPT-2's LM head shares its weight with the token
# embedding (``lm_head.weight is transformer.wte.weight``). A Parameter lives on one
# device, so the head must run where the embedding lives, or the weight must be
# copied, which unties it: one more parameter tensor, and its two gradients must then
# be summed by hand. We keep the tie: the head runs on the FIRST device (as the old
# transformers ``parallelize()`` did) and the final hidden states travel back to it,
# one extra (batch, seq, n_embd) copy per step, much smaller than the weight.

_FIRST, _LAST = "first", "last"  # pinned to the device of layer 0 / of the last layer


def _layout(model: nn.Module) -> list[tuple[str, nn.Module, Union[int, str]]]:
    """``(name, module, layer index | "first" | "last")`` for the placed parts, in execution order."""
    if isinstance(model, nn.Sequential):
        return [(name, module, i) for i, (name, module) in enumerate(model.named_children())]
    body = model.transformer if isinstance(model, GPT2LMHeadModel) else model
    if not isinstance(body, GPT2Model):
        raise TypeError(f"model must be a GPT2LMHeadModel, GPT2Model or nn.Sequential, got "
                        f"{type(model).__name__}; wrap other models' layers in nn.Sequential")
    parts: list[tuple[str, nn.Module, Union[int, str]]] = [("wte", body.wte, _FIRST), ("wpe", body.wpe, _FIRST)]
    parts += [(f"h{i}", block, i) for i, block in enumerate(body.h)]
    parts.append(("ln_f", body.ln_f, _LAST))
    if body is not model:
        parts.append(("lm_head", model.lm_head, _FIRST))  # tied to wte: see the comment above
    return parts


def _n_layers(parts: list[tuple[str, nn.Module, Union[int, str]]]) -> int:
    return sum(isinstance(where, int) for _, _, where in parts)


def placement(model: nn.Module, device_map: Optional[DeviceMap] = None) -> list[tuple[DeviceKey, str, nn.Module]]:
    """``(device key, name, module)`` for every placed part of ``model``, in execution order.

    Args:
        model: a ``GPT2LMHeadModel``, ``GPT2Model`` or ``nn.Sequential``.
        device_map: default ``model.device_map`` when parallelized, else one device ``{0: all}``.
    """
    parts = _layout(model)
    n = _n_layers(parts)
    if device_map is None:
        device_map = getattr(model, "device_map", None) or {0: list(range(n))}
    validate_device_map(device_map, n)
    owner = {layer: key for key, layers in device_map.items() for layer in layers}
    return [(owner[0 if where == _FIRST else n - 1 if where == _LAST else where], name, module)
            for name, module, where in parts]


def _to(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor inside (tuples, lists, dicts) moved to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)  # differentiable: backward copies the gradient back
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


def _move_inputs(device: torch.device, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return _to(args, device), _to(kwargs, device)


def _place(model: nn.Module, device_map: DeviceMap) -> nn.Module:
    owners = placement(model, device_map)
    _remove_hooks(model)
    first = resolve_device(owners[0][0])
    model.to(first)  # anything not listed in the layout (buffers) stays with the inputs
    hooks = [model.register_forward_pre_hook(partial(_move_inputs, first), with_kwargs=True)]
    for key, _, module in owners:
        device = resolve_device(key)
        module.to(device)  # keeps Parameter objects, so the tied head stays tied
        hooks.append(module.register_forward_pre_hook(partial(_move_inputs, device), with_kwargs=True))
    model.device_map = {key: list(layers) for key, layers in device_map.items()}
    model._device_map_hooks = hooks
    return model


def _remove_hooks(model: nn.Module) -> None:
    for handle in model.__dict__.pop("_device_map_hooks", []):
        handle.remove()
    model.__dict__.pop("device_map", None)


def parallelize(model: nn.Module, device_map: Optional[DeviceMap] = None) -> nn.Module:
    """Spread a GPT-2's blocks over devices, in place (naive model parallelism).

    Token and position embeddings and the tied LM head go to the device of layer 0,
    block ``i`` to its mapped device, the final layer norm to the device of the last
    layer. Forward pre-hooks move each part's inputs to its device, so callers pass
    tensors from anywhere and autograd carries gradients back across devices. The map
    is kept as ``model.device_map``; calling again re-maps.

    Args:
        model: a ``transformers`` ``GPT2LMHeadModel`` or ``GPT2Model``.
        device_map: ``{device key: [layer indices]}``, keys as in :mod:`parallel_lib.device_map`; default:
            :func:`get_device_map` over all visible GPUs, or one CPU device.

    Returns:
        The same model object, placed.

    Raises:
        TypeError: ``model`` is not a GPT-2 (use :func:`parallelize_sequential`).
        ValueError: a map that does not cover the layers once each, in order.
    """
    if isinstance(model, nn.Sequential):
        raise TypeError("parallelize() takes a GPT-2 model; use parallelize_sequential() for nn.Sequential")
    if device_map is None:
        device_map = get_device_map(_n_layers(_layout(model)), list(range(max(torch.cuda.device_count(), 1))))
    return _place(model, device_map)


def parallelize_sequential(model: nn.Sequential, device_map: DeviceMap) -> nn.Sequential:
    """Put child ``i`` of an ``nn.Sequential`` on the device whose list holds ``i``, in place.

    The generic form of :func:`parallelize` for any model written as a sequence of
    layers; the output ends on the device of the last child.

    Raises:
        TypeError: ``model`` is not an ``nn.Sequential``.
        ValueError: a map that does not cover the children once each, in order.
    """
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"model must be an nn.Sequential, got {type(model).__name__}")
    return _place(model, device_map)


def deparallelize(model: nn.Module, device: Union[str, torch.device] = "cpu") -> nn.Module:
    """Undo :func:`parallelize`: remove the hooks and the map, move everything to ``device``."""
    _remove_hooks(model)
    return model.to(device)


# --------------------------------------------------------------------------- timeline


def _first_tensor(obj: Any) -> Optional[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (tuple, list)):
        return next((t for t in map(_first_tensor, obj) if t is not None), None)
    return None


def _time_backward(recorder: TimelineRecorder, lane: str, name: str, micro_batch: int,
                   output: torch.Tensor, grad_of: torch.Tensor) -> None:
    """Record a backward event from "the node that made ``output`` starts" to "the grad of ``grad_of`` is ready".

    A node pre-hook fires after the tensor hooks of that node's output, so when one
    part's input *is* the previous part's output (same device), the later part's
    backward ends before the earlier part's begins: hand-overs never overlap.
    """
    started: list[float] = []

    def node_starts(grad_outputs: tuple) -> None:
        started.append(recorder.now())

    def grad_ready(grad: torch.Tensor) -> None:
        if started:
            recorder.add(lane, "backward", micro_batch, started.pop(), recorder.now(), name)

    assert output.grad_fn is not None
    output.grad_fn.register_prehook(node_starts)
    grad_of.register_hook(grad_ready)


def _instrument(recorder: TimelineRecorder, module: nn.Module, lane: str, name: str, state: dict) -> list:
    """Hooks that record ``module``'s forward and, through autograd hooks, its backward."""
    started: list[float] = []

    def before(mod: nn.Module, args: tuple) -> None:
        started.append(recorder.now())

    def after(mod: nn.Module, args: tuple, output: Any) -> None:
        state["end"] = recorder.now()
        recorder.add(lane, "forward", state["step"], started.pop(), state["end"], name)
        x, y = _first_tensor(args), _first_tensor(output)
        if x is not None and y is not None and x.requires_grad and y.grad_fn is not None:
            _time_backward(recorder, lane, name, state["step"], y, x)
        # else: no grad mode, or token ids in: no backward boundary to time

    return [module.register_forward_pre_hook(before), module.register_forward_hook(after)]


@contextmanager
def record_timeline(model: nn.Module, device_map: Optional[DeviceMap] = None) -> Iterator[list[Event]]:
    """Record each placed part's forward and backward as timeline events.

    One lane per device key (:func:`lane_name`), one event per part and pass, labelled
    with the part's name (``"h3"``); ``micro_batch`` counts the model's forward calls
    from 0. A loss the model computes itself (``labels=``) appears as a "loss" part
    on the lane of the last part (the LM head's). CUDA devices in the map are
    synchronised before every time stamp, so bars show when kernels ran rather than
    when they were queued. The embeddings' backward is not drawn: their input is
    token ids, which have no gradient to time.

    Args:
        model: as for :func:`placement`.
        device_map: lanes to use; default ``model.device_map`` (or one device).

    Yields:
        The list of :class:`~parallel_lib.timeline.Event` that fills as the model runs.
    """
    owners = placement(model, device_map)
    cuda = sorted({d for d in (resolve_device(k) for k, _, _ in owners) if d.type == "cuda"}, key=str)
    recorder = TimelineRecorder(partial(synchronize_devices, cuda) if cuda else None)
    state: dict[str, Any] = {"step": -1, "end": 0.0}  # forward calls so far; when the last part finished
    output_lane = lane_name(owners[-1][0])

    def begin(mod: nn.Module, args: tuple) -> None:
        state["step"] += 1

    def finish(mod: nn.Module, args: tuple, output: Any) -> None:
        loss, logits = getattr(output, "loss", None), getattr(output, "logits", None)
        if isinstance(loss, torch.Tensor):  # computed inside forward, after the last part
            recorder.add(output_lane, "forward", state["step"], state["end"], recorder.now(), "loss")
            if loss.grad_fn is not None and isinstance(logits, torch.Tensor) and logits.requires_grad:
                _time_backward(recorder, output_lane, "loss", state["step"], loss, logits)

    handles = [model.register_forward_pre_hook(begin), model.register_forward_hook(finish)]
    for key, name, module in owners:
        handles += _instrument(recorder, module, lane_name(key), name, state)
    try:
        yield recorder.events
    finally:
        for handle in handles:
            handle.remove()


# --------------------------------------------------------------------------- balancing


def _balance(model: nn.Module, cost: dict[str, float], devices: Sequence[DeviceKey]) -> DeviceMap:
    """Map from a cost per part name: blocks are cut, pinned parts load the first/last device."""
    parts = _layout(model)
    pinned = {where: sum(cost.get(name, 0.0) for name, _, w in parts if w == where) for where in (_FIRST, _LAST)}
    blocks = [cost.get(name, 0.0) for name, _, where in parts if isinstance(where, int)]
    return balance_by_cost(blocks, devices, first_cost=pinned[_FIRST], last_cost=pinned[_LAST])


def balance_by_params(model: nn.Module, devices: Sequence[DeviceKey]) -> DeviceMap:
    """Device map that evens out parameter counts (a memory balance).

    For GPT-2 the embeddings (and the tied head, counted once) sit on the first
    device, so with a large vocabulary that device gets fewer blocks.

    Args:
        model: a ``GPT2LMHeadModel``, ``GPT2Model`` or ``nn.Sequential``.
        devices: device keys in pipeline order.
    """
    seen: set[int] = set()
    cost: dict[str, float] = {}
    for name, module, _ in _layout(model):
        fresh = [p for p in module.parameters() if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        cost[name] = float(sum(p.numel() for p in fresh))
    return _balance(model, cost, devices)


def _forward_backward(model: nn.Module, sample: Any) -> None:
    out = model(**sample) if isinstance(sample, dict) else model(sample)
    y = out if isinstance(out, torch.Tensor) else out[0]  # logits, loss or last hidden state
    params = [p for p in model.parameters() if p.requires_grad]
    torch.autograd.grad(y.float().mean(), params)  # fires the timing hooks; leaves .grad untouched


def balance_by_time(model: nn.Module, sample: Any, devices: Sequence[DeviceKey], repeat: int = 3) -> DeviceMap:
    """Device map that evens out measured forward + backward time per device.

    Profiles the model where it currently sits (one warm-up pass, then ``repeat``
    timed passes recorded by :func:`record_timeline`), averages each part's time,
    and cuts the blocks with :func:`~parallel_lib.device_map.balance_by_cost`.
    Parameters' ``.grad`` are not touched.

    Args:
        model: a ``GPT2LMHeadModel``, ``GPT2Model`` or ``nn.Sequential``.
        sample: a representative input: a tensor, or a dict of keyword arguments.
        devices: device keys in pipeline order.
        repeat: timed passes to average (noise shrinks with more).

    Raises:
        ValueError: ``repeat < 1``.
    """
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got repeat={repeat!r}")
    with record_timeline(model) as events:
        for _ in range(repeat + 1):
            _forward_backward(model, sample)
    cost: dict[str, float] = defaultdict(float)
    for event in events:
        if event.micro_batch != 0:  # pass 0 warms up allocators and kernels
            cost[event.label] += event.duration / repeat
    return _balance(model, cost, devices)
