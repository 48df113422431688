"""How fast this machine computes and moves memory: the two numbers of a roofline.

A step that multiplies large matrices is limited by arithmetic (FLOP/s); a step that
reads every weight once to produce one token is limited by memory bandwidth (bytes/s).
Chapter 09 uses both to say why prefill is compute-bound and decoding memory-bound, and
the planner (chapter 10) predicts step times from them. Published peak figures describe
a GPU under ideal conditions; these are measured here, in a second or two, so every
prediction in the course is made for the reader's own machine.

- FLOP/s: the median of timed ``n × n`` matrix products, ``2 n³`` floating-point
  operations each (one multiply and one add per term).
- bytes/s: the median of timed copies of a large buffer, ``2 × size`` bytes each (every
  byte read once and written once). A buffer far larger than the caches is needed, or the
  copy measures the cache instead of memory.

On a GPU every timed region ends with a synchronisation of that device, because kernels
run asynchronously and the clock would otherwise stop before the work does.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Union

import torch

from parallel_lib.common.checks import check_choice, positive_int

__all__ = ["MachineSpeed", "measure_matmul_flops", "measure_memory_bandwidth", "measure_machine_speed"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class MachineSpeed:
    """Measured arithmetic rate and memory bandwidth of one device (one thread on a CPU by default)."""

    device: str
    dtype: str
    threads: int
    flops_per_second: float
    bytes_per_second: float

    @property
    def ridge_intensity(self) -> float:
        """FLOPs per byte at which compute time equals memory time: below it, memory limits a step."""
        return self.flops_per_second / self.bytes_per_second

    def seconds(self, flops: float, nbytes: float) -> float:
        """Roofline time of work doing ``flops`` and moving ``nbytes``: the slower of the two limits."""
        return max(flops / self.flops_per_second, nbytes / self.bytes_per_second)


def _synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _median_seconds(work: Callable[[], object], device: torch.device, repeats: int) -> float:
    sync = _synchronizer(device)
    work()  # warm-up: allocation, kernel selection and caches are not what we measure
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _device(device: Union[str, torch.device]) -> torch.device:
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    return torch.device(device)


def measure_matmul_flops(device: Union[str, torch.device] = "cpu", size: int = 512, repeats: int = 5,
                         dtype: str = "fp32") -> float:
    """FLOP/s of ``size × size`` matrix products on ``device``: ``2 size³`` operations each, median of ``repeats``."""
    size, repeats = positive_int("size", size), positive_int("repeats", repeats)
    where = _device(device)
    kind = _DTYPES[check_choice("dtype", dtype, _DTYPES)]
    a = torch.randn(size, size, device=where, dtype=kind)
    b = torch.randn(size, size, device=where, dtype=kind)
    return 2 * size**3 / _median_seconds(lambda: a @ b, where, repeats)


def measure_memory_bandwidth(device: Union[str, torch.device] = "cpu", megabytes: int = 64, repeats: int = 5) -> float:
    """Bytes/s of copying a ``megabytes`` buffer on ``device`` (each byte read and written), median of ``repeats``."""
    megabytes, repeats = positive_int("megabytes", megabytes), positive_int("repeats", repeats)
    where = _device(device)
    source = torch.ones(megabytes * 2**20 // 4, device=where)
    target = torch.empty_like(source)
    return 2 * source.numel() * 4 / _median_seconds(lambda: target.copy_(source), where, repeats)


def measure_machine_speed(device: Union[str, torch.device] = "cpu", size: int = 512, megabytes: int = 64,
                          repeats: int = 5, dtype: str = "fp32") -> MachineSpeed:
    """Both roofline numbers of ``device``, measured with the current thread count (see ``torch.get_num_threads``)."""
    return MachineSpeed(device=str(_device(device)), dtype=dtype, threads=torch.get_num_threads(),
                        flops_per_second=measure_matmul_flops(device, size, repeats, dtype),
                        bytes_per_second=measure_memory_bandwidth(device, megabytes, repeats))
