"""Naive model parallelism: run a model's consecutive blocks on different devices.

:func:`parallelize` places a Hugging Face GPT-2 according to a device map
(:mod:`parallel_lib.model_parallel.device_map`) and makes the hand-over between devices invisible
to the caller: forward pre-hooks move each part's inputs to that part's device,
and because ``Tensor.to`` is differentiable, autograd sends the gradients back the
same way. Nothing in ``transformers`` is patched, so the model's own ``forward``
(masks, loss, generation) runs unchanged — current ``transformers`` removed GPT-2's
``parallelize()``, and hooks are the least intrusive way to bring it back.

Only one device works at a time: block ``i + 1`` needs block ``i``'s output.
:mod:`.timeline` measures exactly that, and :mod:`.balance` chooses the cut that keeps
the busiest device least busy.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Optional, Union

import torch
from torch import nn
from transformers import GPT2LMHeadModel, GPT2Model

from parallel_lib.model_parallel.device_map import DeviceKey, DeviceMap, get_device_map, validate_device_map
from parallel_lib.runtime.device import resolve_device

__all__ = ["placement", "layout", "move_inputs", "place_layers", "parallelize", "parallelize_sequential", "deparallelize", "FIRST", "LAST"]

# Where each part of the model runs. GPT-2's LM head shares its weight with the token
# embedding (``lm_head.weight is transformer.wte.weight``). A Parameter lives on one
# device, so the head must run where the embedding lives, or the weight must be
# copied, which unties it: one more parameter tensor, and its two gradients must then
# be summed by hand. We keep the tie: the head runs on the FIRST device (as the old
# transformers ``parallelize()`` did) and the final hidden states travel back to it,
# one extra (batch, seq, n_embd) copy per step, much smaller than the weight.

FIRST, LAST = "first", "last"  # pinned to the device of layer 0 / of the last layer


def layout(model: nn.Module) -> list[tuple[str, nn.Module, Union[int, str]]]:
    """``(name, module, layer index | "first" | "last")`` for the placed parts, in execution order."""
    if isinstance(model, nn.Sequential):
        return [(name, module, i) for i, (name, module) in enumerate(model.named_children())]
    body = model.transformer if isinstance(model, GPT2LMHeadModel) else model
    if not isinstance(body, GPT2Model):
        raise TypeError(f"model must be a GPT2LMHeadModel, GPT2Model or nn.Sequential, got "
                        f"{type(model).__name__}; wrap other models' layers in nn.Sequential")
    parts: list[tuple[str, nn.Module, Union[int, str]]] = [("wte", body.wte, FIRST), ("wpe", body.wpe, FIRST)]
    parts += [(f"h{i}", block, i) for i, block in enumerate(body.h)]
    parts.append(("ln_f", body.ln_f, LAST))
    if body is not model:
        parts.append(("lm_head", model.lm_head, FIRST))  # tied to wte: see the comment above
    return parts


def _n_layers(parts: list[tuple[str, nn.Module, Union[int, str]]]) -> int:
    return sum(isinstance(where, int) for _, _, where in parts)


def placement(model: nn.Module, device_map: Optional[DeviceMap] = None) -> list[tuple[DeviceKey, str, nn.Module]]:
    """``(device key, name, module)`` for every placed part of ``model``, in execution order.

    Args:
        model: a ``GPT2LMHeadModel``, ``GPT2Model`` or ``nn.Sequential``.
        device_map: default ``model.device_map`` when parallelized, else one device ``{0: all}``.
    """
    parts = layout(model)
    n = _n_layers(parts)
    if device_map is None:
        device_map = getattr(model, "device_map", None) or {0: list(range(n))}
    validate_device_map(device_map, n)
    owner = {layer: key for key, layers in device_map.items() for layer in layers}
    return [(owner[0 if where == FIRST else n - 1 if where == LAST else where], name, module)
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


def move_inputs(device: torch.device, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook (bound to ``device`` with ``partial``): every tensor argument moved to ``device``."""
    return _to(args, device), _to(kwargs, device)


def _outside_parts(model: nn.Module, parts: list[tuple[DeviceKey, str, nn.Module]]) -> list[nn.Module]:
    """``model`` and the submodules that belong to no placed part (for GPT-2: containers such as
    ``transformer`` and ``drop``, which hold no tensors of their own)."""
    inside = {id(m) for _, _, part in parts for m in part.modules()}
    return [m for m in model.modules() if id(m) not in inside]


def place_layers(model: nn.Module, device_map: DeviceMap) -> nn.Module:
    """Move each placed part straight to its device and hook its inputs there, in place.

    Nothing passes through another device on the way: a model that needs model
    parallelism is one that does not fit on one device, so first moving all of it to
    the first device (and then the parts onward) would run that device out of memory.
    Each part's parameters and buffers move with it; tensors that belong to no part go
    with the model's inputs, to the first device.

    Args:
        model: as for :func:`placement`.
        device_map: ``{device key: [layer indices]}``.

    Returns:
        The same model object, placed, with the map kept as ``model.device_map``.

    Raises:
        ValueError: a map that does not cover the layers once each, in order, or a key naming a
            GPU this machine does not have (checked before anything moves).
    """
    owners = placement(model, device_map)
    targets = [resolve_device(key) for key, _, _ in owners]
    _remove_hooks(model)
    first = targets[0]
    for module in _outside_parts(model, owners):
        module._apply(partial(torch.Tensor.to, device=first), recurse=False)  # its own tensors, not its children's
    hooks = [model.register_forward_pre_hook(partial(move_inputs, first), with_kwargs=True)]
    for (_, _, module), device in zip(owners, targets):
        module.to(device)  # keeps Parameter objects, so the tied head stays tied
        hooks.append(module.register_forward_pre_hook(partial(move_inputs, device), with_kwargs=True))
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
        device_map: ``{device key: [layer indices]}``, keys as in :mod:`parallel_lib.model_parallel.device_map`; default:
            :func:`get_device_map` over all visible GPUs, or one CPU device. Each part moves straight
            to its own device (see :func:`place_layers`).

    Returns:
        The same model object, placed.

    Raises:
        TypeError: ``model`` is not a GPT-2 (use :func:`parallelize_sequential`).
        ValueError: a map that does not cover the layers once each, in order, or a key naming a
            GPU this machine does not have.
    """
    if isinstance(model, nn.Sequential):
        raise TypeError("parallelize() takes a GPT-2 model; use parallelize_sequential() for nn.Sequential")
    if device_map is None:
        device_map = get_device_map(_n_layers(layout(model)), list(range(max(torch.cuda.device_count(), 1))))
    return place_layers(model, device_map)


def parallelize_sequential(model: nn.Sequential, device_map: DeviceMap) -> nn.Sequential:
    """Put child ``i`` of an ``nn.Sequential`` on the device whose list holds ``i``, in place.

    The generic form of :func:`parallelize` for any model written as a sequence of
    layers; the output ends on the device of the last child.

    Raises:
        TypeError: ``model`` is not an ``nn.Sequential``.
        ValueError: a map that does not cover the children once each, in order, or a key naming a
            GPU this machine does not have.
    """
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"model must be an nn.Sequential, got {type(model).__name__}")
    return place_layers(model, device_map)


def deparallelize(model: nn.Module, device: Union[str, torch.device] = "cpu") -> nn.Module:
    """Undo :func:`parallelize`: remove the hooks and the map, move everything to ``device``."""
    _remove_hooks(model)
    return model.to(device)
