"""Which devices a rank or a model-parallel process computes on.

One rule for every chapter: an int device key ``k`` means "the k-th accelerator";
on a machine without GPUs every key runs on the CPU, so the course's several-device
code paths (transfers, schedules, timelines) run unchanged on a laptop.
"""

from __future__ import annotations

import os
from typing import Hashable, Sequence, Union

import torch
import torch.distributed as dist

from parallel_lib.common.checks import positive_int

__all__ = ["DeviceKey", "cpu_count", "rank_device", "devices", "resolve_device", "check_device_keys"]

DeviceKey = Union[int, str, torch.device]  # an int k (the k-th accelerator), or a device such as "cpu" or "cuda:1"


def cpu_count() -> int:
    """Cores this process may run on (a container's limit, not the host's core count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def rank_device() -> torch.device:
    """The device this rank computes on: its own GPU under NCCL, else the CPU."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())  # set from LOCAL_RANK at init
    return torch.device("cpu")


def devices(n: int) -> list[torch.device]:
    """``n`` devices for model or pipeline parallelism within one process.

    ``cuda:0 .. cuda:n-1`` when there are at least ``n`` GPUs, else ``n`` times the CPU:
    the stages then share one device, so the code paths (transfers, schedules, timelines)
    are the real ones even though nothing runs side by side on the hardware.

    Raises:
        ValueError: ``n`` is not a positive int.
    """
    positive_int("n", n)
    if torch.cuda.device_count() >= n:
        return [torch.device("cuda", i) for i in range(n)]
    return [torch.device("cpu")] * n


def check_device_keys(devices: Sequence[DeviceKey]) -> list[DeviceKey]:
    devices = list(devices)
    if not devices:
        raise ValueError("devices must name at least one device, got devices=[]; e.g. devices=[0, 1]")
    for d in devices:
        # bool is an int subclass: True would silently mean device 1
        if isinstance(d, bool) or not isinstance(d, (int, str, torch.device)):
            raise TypeError(f"each device must be an int, str or torch.device, got {d!r} in devices={devices!r}")
        if isinstance(d, int) and d < 0:
            raise ValueError(f"device indices must be >= 0, got {d} in devices={devices!r}")
    keys: list[Hashable] = [str(d) if isinstance(d, torch.device) else d for d in devices]
    if len(set(keys)) != len(keys):
        raise ValueError(f"devices must be distinct, got devices={devices!r}")
    return devices


def resolve_device(key: DeviceKey) -> torch.device:
    """The ``torch.device`` a map key's layers run on.

    An int ``k`` means "the k-th accelerator": ``cuda:k`` when that GPU exists,
    otherwise ``cpu`` (so a CPU-only machine can still run a several-device map).
    A string or ``torch.device`` is used as given.

    Raises:
        TypeError: a key that is not an int, str or ``torch.device``.
    """
    check_device_keys([key])
    if isinstance(key, int):
        return torch.device("cuda", key) if key < torch.cuda.device_count() else torch.device("cpu")
    return torch.device(key)
