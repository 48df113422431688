"""Guards that turn two silent misuses of a ZeRO-managed model into errors that say what to call.

1. **A freed stage-3 parameter.** Between uses, ZeRO-3 resizes a layer group's flat buffer to
   zero bytes (:meth:`~parallel_lib.sharding.flat.FlatParamGroup.free`); the parameters keep
   their shapes but point at no memory, so ``p.sum()``, ``model.state_dict()[k].sum()`` or
   ``model.load_state_dict(...)`` would read or write freed memory (a SIGSEGV, or garbage
   written by ``torch.save``). :func:`guard_parameter` makes each managed parameter a
   :class:`ShardedParameter`: every torch operation on it first checks that its storage is
   there, and raises :class:`FreedParameterError` naming ``engine.gathered()`` and
   ``engine.full_state_dict()`` when it is not. Questions about the tensor that read no values
   (shape, dtype, ``.grad``, the storage pointer) stay allowed, and a gathered parameter
   behaves as a plain ``nn.Parameter``.
2. **``torch.nn.utils.clip_grad_norm_`` on a ZeRO model.** Stages 2-3 have already packed
   and freed every ``.grad`` when it runs (it clips nothing and returns 0), and stages 0-1
   hold each rank's *local* gradient before the average (it clips by the wrong norm).
   :func:`install_clip_guard` wraps the torch function once so that parameters marked by an
   engine raise :class:`RuntimeError` naming ``engine.clip_grad_norm_``, which clips by the
   norm of the averaged gradient. Code that imported the function before the wrap
   (``from torch.nn.utils import clip_grad_norm_`` at module top) is not covered.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["FreedParameterError", "ShardedParameter", "guard_parameter", "unguard_parameter", "install_clip_guard",
           "refuse_freed_state_dicts", "ENGINE_MARK"]

ENGINE_MARK = "_zero_engine"  # attribute set on every parameter an engine manages

_T = torch.Tensor
# operations that read no element of the tensor: allowed on a freed parameter
_NO_VALUES = {getattr(_T, name).__get__ for name in (
    "shape", "dtype", "device", "requires_grad", "grad", "is_leaf", "grad_fn", "ndim", "layout", "is_cuda",
    "is_meta", "is_sparse", "is_quantized", "is_nested", "_base", "itemsize", "nbytes", "_version")
    if hasattr(_T, name)}
_NO_VALUES |= {_T.grad.__set__, _T.data.__set__, _T.requires_grad.__set__}
_NO_VALUES |= {getattr(_T, name) for name in (
    "size", "dim", "numel", "nelement", "stride", "storage_offset", "untyped_storage", "data_ptr", "element_size",
    "is_contiguous", "is_floating_point", "is_complex", "get_device", "_is_view", "register_hook",
    "register_post_accumulate_grad_hook", "requires_grad_", "__hash__", "__len__")}


class FreedParameterError(RuntimeError):
    """A freed ZeRO-3 parameter was read or written outside the engine's forward and backward."""


def _is_freed(tensor: torch.Tensor) -> bool:
    with torch._C.DisableTorchFunctionSubclass():
        return tensor.numel() > 0 and tensor.untyped_storage().nbytes() == 0


def _freed_arguments(args: Any) -> list[str]:
    found: list[str] = []
    for a in args:
        if isinstance(a, ShardedParameter) and _is_freed(a):
            found.append(getattr(a, "_zero_name", "?"))
        elif isinstance(a, (list, tuple)):
            found += _freed_arguments(a)
        elif isinstance(a, dict):
            found += _freed_arguments(a.values())
    return found


class ShardedParameter(nn.Parameter):
    """An ``nn.Parameter`` of a ZeRO-3 model: any operation that reads it while freed raises.

    Raises:
        FreedParameterError: from any torch operation on a freed parameter other than the
            value-free ones (shape, dtype, ``.grad``, ...).
    """

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func not in _NO_VALUES:
            freed = _freed_arguments(args) + _freed_arguments(kwargs.values())
            if freed:
                name = getattr(func, "__name__", str(func))
                raise FreedParameterError(
                    f"{name} on the ZeRO-3 parameter {freed[0]!r}, whose memory is freed between uses (only this "
                    "rank's shard is kept); gather it first on every rank: 'with engine.gathered(): ...' to read or "
                    "load parameters in place, or 'engine.full_state_dict()' for a plain state dict to save")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def guard_parameter(param: nn.Parameter) -> None:
    """Make ``param`` a :class:`ShardedParameter` in place (a plain ``nn.Parameter`` only)."""
    if type(param) is nn.Parameter:
        param.__class__ = ShardedParameter


def unguard_parameter(param: nn.Parameter) -> None:
    """Undo :func:`guard_parameter`."""
    if type(param) is ShardedParameter:
        param.__class__ = nn.Parameter


def install_clip_guard() -> None:
    """Wrap ``torch.nn.utils.clip_grad_norm_`` (once) to refuse parameters an engine manages.

    The wrapped call behaves as torch's for every other parameter.
    """
    original = torch.nn.utils.clip_grad_norm_
    if getattr(original, "_zero_guard", False):
        return

    @functools.wraps(original)
    def clip_grad_norm_(parameters: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if any(getattr(p, ENGINE_MARK, False) for p in params):
            raise RuntimeError(
                "torch.nn.utils.clip_grad_norm_ on a ZeroEngine's parameters clips the wrong gradients (stages 0-1: "
                "each rank's own before the average; stages 2-3: none, they are already reduce-scattered and freed); "
                "call engine.clip_grad_norm_(max_norm) between backward and engine.step() instead")
        return original(params, *args, **kwargs)

    clip_grad_norm_._zero_guard = True  # type: ignore[attr-defined]
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    torch.nn.utils.clip_grad.clip_grad_norm_ = clip_grad_norm_  # type: ignore[attr-defined]


def refuse_freed_state_dicts(model: nn.Module, freed: Callable[[], bool]) -> list[RemovableHandle]:
    """Make ``model.state_dict()`` and ``model.load_state_dict(...)`` raise while ``freed()`` is true.

    Both would otherwise walk parameters with no storage (a stage-3 model between steps); the
    errors name the two ways that work. Returns the hooks' handles (``.remove()`` them to undo).
    """
    def refuse_save(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if freed():
            raise RuntimeError("model.state_dict() of a ZeRO-3 model between steps: its parameters are freed (only "
                               "this rank's shard is kept); call engine.full_state_dict() on every rank for the "
                               "full state, or take it inside 'with engine.gathered():'")

    def refuse_load(module: nn.Module, *args: Any) -> None:
        if freed():
            raise RuntimeError("model.load_state_dict(...) of a ZeRO-3 model between steps: its parameters are freed "
                               "(only this rank's shard is kept); load on every rank inside the gathered block: "
                               "'with engine.gathered(): model.load_state_dict(state)'")

    return [model.register_state_dict_pre_hook(refuse_save), model.register_load_state_dict_pre_hook(refuse_load)]
