"""What reaches a device and what stays alive: the tensor census of GPU item 4, on the meta device.

``Moved`` counts the values copied to the meta device (``Module.to`` and ``Tensor.to`` are one
``aten._to_copy`` per tensor); :func:`live_parameters` counts the parameters alive in the process,
by device type, from the garbage collector's view (what a rank really keeps, whoever holds it).
"""

from __future__ import annotations

import gc

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


class Moved(TorchDispatchMode):
    """Counts the values every ``.to(meta)`` in the block copies onto the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and isinstance(out, torch.Tensor) and out.device.type == "meta":
            self.numel += out.numel()
        return out


def live_parameters(device_type: str) -> int:
    """Values of every ``nn.Parameter`` alive in this process on ``device_type`` (after a collection)."""
    gc.collect()
    return sum(o.numel() for o in gc.get_objects() if type(o) is nn.Parameter and o.device.type == device_type)
