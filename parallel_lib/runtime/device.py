"""Which devices a rank or a model-parallel process computes on.

One rule for every chapter, with no silent fallback:

- an int device key ``k`` means "the k-th GPU", ``cuda:k``;
- on a machine with no GPU, every int key runs on the CPU: the course's CPU mode, in which
  the several-device code paths (transfers, schedules, timelines) run unchanged on a laptop;
- on a machine with GPUs, a key naming a GPU it does not have is a ``ValueError`` that says
  how many there are. Quietly running "GPU 2" on the CPU of a 2-GPU node would turn a typo
  into a hand-over to the CPU and a timeline that lies about where the work ran.

Strings and ``torch.device`` keys (``"cpu"``, ``"cuda:1"``, ``"meta"``) are used as given,
with the same check for a GPU that is not there.
"""

from __future__ import annotations

import os
from typing import Hashable, Iterable, Sequence, Union

import torch
import torch.distributed as dist

from parallel_lib.common.checks import positive_int

__all__ = ["DeviceKey", "cpu_count", "rank_device", "devices", "resolve_device", "check_device_keys"]

DeviceKey = Union[int, str, torch.device]  # an int k (the k-th GPU; the CPU without GPUs), or "cpu", "cuda:1", ...


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
    """``n`` devices for model or pipeline parallelism within one process, by the rule above.

    ``cuda:0 .. cuda:n-1`` when there are at least ``n`` GPUs; ``n`` times the CPU when
    there is no GPU (the stages then share one device, so the code paths are the real
    ones even though nothing runs side by side on the hardware).

    Raises:
        ValueError: ``n`` is not a positive int, or the machine has GPUs but fewer than ``n``.
    """
    positive_int("n", n)
    gpus = torch.cuda.device_count()
    if gpus == 0:
        return [torch.device("cpu")] * n
    if n > gpus:
        raise ValueError(f"devices(n={n}) needs {n} GPUs, but this machine has {_gpu_names(gpus)}; {_FIX}")
    return [torch.device("cuda", i) for i in range(n)]


def check_device_keys(devices: Sequence[DeviceKey]) -> list[DeviceKey]:
    """``devices`` as a list, if every key is an int >= 0, a str or a ``torch.device``, and distinct.

    Raises:
        TypeError: ``devices`` is one key instead of a list of keys (``"cpu"`` would be read as
            the devices "c", "p", "u"; ``2`` is not a list), or a key of another type (``True``
            included: it would silently mean device 1).
        ValueError: no key, a negative int, or a key given twice.
    """
    if isinstance(devices, (str, int, torch.device)):
        example = f"list(range({devices}))" if isinstance(devices, int) and not isinstance(devices, bool) else \
            f"[{devices!r}, ...] with one key per device (ints such as [0, 1] give several devices on the CPU too)"
        raise TypeError(f"devices must be a list of device keys, one per device, got devices={devices!r} "
                        f"({type(devices).__name__}); e.g. {example}")
    if not isinstance(devices, Iterable):
        raise TypeError(f"devices must be a list of device keys, got devices={devices!r} ({type(devices).__name__})")
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
    """The ``torch.device`` a map key's layers run on, by the rule in this module's docstring.

    An int ``k`` is ``cuda:k``, or ``cpu`` on a machine without GPUs. A string or
    ``torch.device`` is used as given.

    Raises:
        TypeError: a key that is not an int, str or ``torch.device``.
        ValueError: a negative int, or a key naming a GPU this machine does not have.
    """
    check_device_keys([key])
    gpus = torch.cuda.device_count()
    if isinstance(key, int):
        if gpus == 0:
            return torch.device("cpu")  # the CPU mode: every key, one CPU
        device = torch.device("cuda", key)
    else:
        device = torch.device(key)
    if device.type == "cuda" and (device.index or 0) >= gpus:
        raise ValueError(f"device key {key!r} names GPU {device.index or 0}, but this machine has "
                         f"{_gpu_names(gpus)}; {_FIX}")
    return device


# what to do about a key or count that names a GPU the machine does not have
_FIX = ("use fewer devices, or 'cpu', or hide the GPUs (CUDA_VISIBLE_DEVICES=) to run every int key on the CPU")


def _gpu_names(gpus: int) -> str:
    """``"no GPU"``, ``"1 GPU (cuda:0)"`` or ``"2 GPUs (cuda:0..cuda:1)"``."""
    if gpus == 0:
        return "no GPU"
    return "1 GPU (cuda:0)" if gpus == 1 else f"{gpus} GPUs (cuda:0..cuda:{gpus - 1})"
