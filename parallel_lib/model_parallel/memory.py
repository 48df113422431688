"""Memory of training: the standard estimates, and what the tensors really hold.

Model parallelism exists because a model's training state does not fit on one
device. The estimates here answer "does it fit?" before buying hardware (bytes per
parameter for weights, gradients and optimizer states; bytes per layer for
activations, each with its source), and :func:`memory_report` measures the same
quantities on a model placed by :func:`parallel_lib.model_parallel.parallelize`,
device by device, so a reader can hold the estimate against the measurement.

Sizes are in bytes, memory shown in GiB (2**30); the convention is stated once in
:mod:`parallel_lib.cost.units`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from parallel_lib.common.checks import check_choice, check_int, check_number, positive_int, positive_number
from parallel_lib.cost.activation import activation_bytes
from parallel_lib.cost.shape import GPTShape, shape_of
from parallel_lib.cost.units import GiB  # a "16 GB" V100 holds 16 GiB
from parallel_lib.model_parallel.placing import placement
from parallel_lib.runtime.device import DeviceKey, resolve_device

__all__ = [
    "DTYPE_BYTES",
    "OPTIMIZER_STATES",
    "TrainingMemory",
    "training_memory",
    "DeviceMemory",
    "memory_report",
    "format_memory_report",
    "model_memory",
    "memory_verdict",
    "check_device_bytes",
    "GiB",
]

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# fp32 values the optimizer keeps per parameter: Adam's first and second moments, SGD's momentum
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd_momentum": 1, "sgd": 0}


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes of training state, by kind, for the whole model."""

    weights: float  # in the training dtype
    gradients: float  # same dtype as the weights
    master_weights: float  # fp32 copy that mixed precision updates
    optimizer_states: float  # fp32 moments
    activations: float = 0.0  # whatever the caller adds (see parallel_lib.cost.activation.activation_bytes)

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.master_weights + self.optimizer_states + self.activations

    def per_device(self, n_devices: int) -> float:
        """Bytes on each of ``n_devices`` when the layers are split evenly (model parallel).

        Raises:
            ValueError: ``n_devices`` is not an int >= 1 (2.5 devices do not exist).
        """
        return self.total / positive_int("n_devices", n_devices)

    def min_devices(self, device_bytes: float) -> int:
        """Fewest devices of ``device_bytes`` each that hold it under an even split.

        Raises:
            ValueError: ``device_bytes`` not a finite number >= 1 MiB (zero, negative, or GiB
                passed where bytes are expected).
        """
        return max(1, math.ceil(self.total / check_device_bytes(device_bytes)))


def check_device_bytes(device_bytes: float, name: str = "device_bytes") -> float:
    """``device_bytes`` as a float, if it is a plausible device memory in bytes (at least 1 MiB).

    No accelerator has less than a mebibyte, so a smaller number is nearly always GiB
    given where bytes are expected (``80`` for an 80 GiB GPU); it is an error rather
    than a verdict that nothing fits.
    """
    value = positive_number(name, device_bytes)
    if value < 2 ** 20:
        raise ValueError(f"{name} is in bytes and must be at least 1 MiB, got {name}={device_bytes!r}; "
                         f"for {device_bytes!r} GiB pass {device_bytes!r} * GiB (= {value * GiB:.0f})")
    return value


def training_memory(n_params: int, dtype: str = "fp32", optimizer: Optional[str] = "adamw",
                    activations: float = 0.0) -> TrainingMemory:
    """Standard estimate of the memory to train (or, without optimizer, run) a model.

    Per parameter: the weights and their gradients in ``dtype``; with 16-bit
    ``dtype`` (mixed precision) also an fp32 master copy; and the optimizer's fp32
    states (Adam: 2, SGD with momentum: 1). Mixed-precision Adam thus needs
    2 + 2 + 4 + 4 + 4 = 16 bytes per parameter, the figure of Rajbhandari et al.
    2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
    sec. 3.1; fp32 Adam also needs 4 + 4 + 8 = 16. Framework buffers, temporary
    tensors and fragmentation come on top.

    Args:
        n_params: number of parameters.
        dtype: "fp32", "bf16" or "fp16" (the latter two mean mixed precision).
        optimizer: "adamw", "adam", "sgd_momentum", "sgd", or None for inference
            (weights only: no gradients, no master copy, no states).
        activations: activation bytes to include (e.g. from :func:`parallel_lib.cost.activation.activation_bytes`).

    Raises:
        ValueError: ``n_params`` negative or not a finite number, or an unknown ``dtype`` / ``optimizer``.
    """
    check_number("n_params", n_params, 0.0)
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got dtype={dtype!r}")
    if optimizer is not None and optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATES)} or None, got optimizer={optimizer!r}")
    width = DTYPE_BYTES[dtype]
    if optimizer is None:
        return TrainingMemory(n_params * width, 0.0, 0.0, 0.0, activations)
    master = 4 * n_params if width < 4 else 0.0
    return TrainingMemory(n_params * width, n_params * width, master, 4 * OPTIMIZER_STATES[optimizer] * n_params,
                          activations)


@dataclass(frozen=True)
class DeviceMemory:
    """Measured bytes held by the parts of a model mapped to one device key."""

    device: str  # where the tensors are, e.g. "cpu" or "cuda:1"
    parameters: int
    gradients: int
    optimizer_state: int
    cuda_peak: Optional[int] = None  # torch.cuda.max_memory_allocated, CUDA devices only

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def memory_report(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> dict[DeviceKey, DeviceMemory]:
    """Parameter, gradient and optimizer-state bytes per device key, from the tensors.

    A tied weight (GPT-2's head) is counted once, with the first part that holds it.

    Args:
        model: a model placed by ``parallelize`` (or an unplaced one: one key, 0).
        optimizer: its optimizer, to count states (after a step, Adam holds two per parameter).
    """
    seen: set[int] = set()
    totals: dict[DeviceKey, list[int]] = {}  # key -> [parameter, gradient, state] bytes
    devices: dict[DeviceKey, torch.device] = {}
    for key, _, module in placement(model):
        fresh = [p for p in module.parameters() if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        states = [s for p in fresh for s in (optimizer.state.get(p, {}).values() if optimizer else [])]
        row = totals.setdefault(key, [0, 0, 0])
        row[0] += sum(_nbytes(p) for p in fresh)
        row[1] += sum(_nbytes(p.grad) for p in fresh if p.grad is not None)
        row[2] += sum(_nbytes(s) for s in states if isinstance(s, torch.Tensor))
        if fresh:
            devices.setdefault(key, fresh[0].device)
    report: dict[DeviceKey, DeviceMemory] = {}
    for key, (params, grads, states_bytes) in totals.items():
        device = devices.get(key, resolve_device(key))
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        report[key] = DeviceMemory(str(device), params, grads, states_bytes, peak)
    return report


def format_memory_report(report: dict[DeviceKey, DeviceMemory]) -> str:
    """A fixed-width table of a :func:`memory_report`, in MB (10**6 bytes)."""
    lines = [f"{'key':>8} {'device':>8} {'params MB':>10} {'grads MB':>9} {'optim MB':>9} {'total MB':>9} "
             f"{'CUDA peak MB':>13}"]
    for key, row in report.items():
        peak = "n/a" if row.cuda_peak is None else f"{row.cuda_peak / 1e6:.2f}"
        lines.append(f"{key!s:>8} {row.device:>8} {row.parameters / 1e6:>10.2f} {row.gradients / 1e6:>9.2f} "
                     f"{row.optimizer_state / 1e6:>9.2f} {row.total / 1e6:>9.2f} {peak:>13}")
    return "\n".join(lines)


def model_memory(model: str | GPTShape, dtype: str = "fp16", optimizer: Optional[str] = "adamw", batch_size: int = 0,
                 attention_scores: bool = False) -> TrainingMemory:
    """:func:`training_memory` of a model, plus activations for ``batch_size`` sequences.

    ``model`` is a published name from :data:`parallel_lib.cost.shape.SHAPES` or a
    :class:`~parallel_lib.cost.shape.GPTShape`; its parameters are :meth:`GPTShape.parameters`.
    Activations (:func:`parallel_lib.cost.activation.activation_bytes`, Korthikanti et al. 2022) use
    the model's full context length (``n_positions``), values of ``dtype``'s width and byte dropout
    masks, and assume a FlashAttention-style kernel (no stored score matrices) unless
    ``attention_scores``; ``batch_size=0`` leaves them out.

    Raises:
        ValueError: an unknown ``model`` or ``dtype``, or a ``batch_size`` that is not an int >= 0.
    """
    shape = shape_of(model)
    width = DTYPE_BYTES[check_choice("dtype", dtype, DTYPE_BYTES)]
    check_int("batch_size", batch_size, 0, hint="0 leaves the activations out")
    acts = 0.0
    if batch_size and optimizer is not None:  # inference keeps no activations for a backward pass
        acts = activation_bytes(batch_size, shape.n_positions, shape, attention_scores=attention_scores,
                                bytes_per_element=width)
    return training_memory(shape.parameters(), dtype, optimizer, acts)


def memory_verdict(estimate: TrainingMemory, n_devices: int, device_bytes: float) -> str:
    """One sentence: per-device need on ``n_devices`` devices of ``device_bytes``, and whether it fits.

    Raises:
        ValueError: ``n_devices`` not an int >= 1, or ``device_bytes`` not a plausible
            number of bytes (see :func:`check_device_bytes`).
    """
    per_device = estimate.per_device(n_devices)
    needed = estimate.min_devices(device_bytes)
    fits = "fits" if per_device <= device_bytes else f"does NOT fit (needs at least {needed})"
    return (f"{estimate.total / GiB:.1f} GiB in total -> {per_device / GiB:.1f} GiB per device on "
            f"{n_devices} x {device_bytes / GiB:.0f} GiB: {fits}")
