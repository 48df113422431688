"""Exercises for chapter 03: a device map that leaves no device idle, and the memory of training."""

from __future__ import annotations

from typing import Any, Optional

from parallel_lib.exercises import solutions
from parallel_lib.exercises._core import (
    Case,
    CheckResult,
    Exercise,
    as_int,
    as_number,
    check_function,
    same_number,
    show,
)
from parallel_lib.model_parallel.device_map import get_device_map, naive_device_map, validate_device_map
from parallel_lib.model_parallel.memory import training_memory

__all__ = ["check_balanced_device_map", "check_training_bytes", "EXERCISES"]

DEVICE_MAP_STUB = '''\
def balanced_device_map(n_layers, n_devices):
    """{device: [layer indices]} for devices 0 .. n_devices-1: consecutive layers, in order,
    with block sizes that differ by at most one (the ceil(n_layers / n_devices) recipe
    leaves a device idle for 12 layers on 5 devices).
    """
    ...  # your code here
'''

TRAINING_BYTES_STUB = '''\
def training_bytes(n_params, dtype="fp16", optimizer="adamw"):
    """Bytes to train a model of `n_params` parameters (activations not counted).

    Per parameter: the weights and their gradients in `dtype` ("fp32": 4 bytes, "fp16"/"bf16": 2);
    with a 16-bit dtype (mixed precision) also an fp32 master copy of the weights; plus the
    optimizer's fp32 states: "adamw" keeps 2 per parameter, "sgd_momentum" 1, "sgd" 0.
    optimizer=None means inference: the weights only.
    """
    ...  # your code here
'''


def _as_device_map(value: Any) -> dict[int, list[int]]:
    if not isinstance(value, dict):
        raise TypeError("a dict {device: [layer indices]}")
    return {as_int(device): [as_int(layer) for layer in layers] for device, layers in value.items()}


def _compare_maps(expected: dict[int, list[int]], got: dict[int, list[int]]) -> Optional[str]:
    """Any contiguous map over devices 0..n-1 with sizes within one of each other passes."""
    n_layers = sum(len(layers) for layers in expected.values())
    if list(got) != list(expected):
        return f"the devices must be {list(expected)}, in order, got {list(got)}; e.g. {show(expected)}"
    try:
        validate_device_map(got, n_layers)
    except ValueError:
        return (f"layers 0..{n_layers - 1} must appear once each, consecutive and in device order, "
                f"got {show(got)}; e.g. {show(expected)}")
    sizes = [len(layers) for layers in got.values()]
    if max(sizes) - min(sizes) > 1:
        return f"block sizes {sizes} differ by more than one: expected e.g. {show(expected)}, got {show(got)}"
    return None


def _map_hint(args: tuple, got: Any) -> str:
    n_layers, n_devices = args
    if got == naive_device_map(n_layers, list(range(n_devices))):
        return ("that is the ceil(n_layers / n_devices) recipe: give every device n_layers // n_devices "
                "layers and the first n_layers % n_devices devices one more")
    return "every device gets n_layers // n_devices layers, the first n_layers % n_devices one more"


def check_balanced_device_map(fn: Any) -> CheckResult:
    """Check ``balanced_device_map(n_layers, n_devices)``; failures show ``get_device_map``'s map."""
    shapes = [(12, 2), (12, 4), (12, 5), (4, 4), (1, 1), (13, 4), (48, 7), (3, 5)]
    cases = [Case(shape, get_device_map(shape[0], list(range(shape[1])))) for shape in shapes]
    return check_function("balanced_device_map", fn, "balanced_device_map", cases, normalise=_as_device_map,
                          compare=_compare_maps, hint=_map_hint)


def _training_hint(args: tuple, got: Any) -> str:
    n_params, dtype, optimizer = args
    memory = training_memory(n_params, dtype, optimizer)
    parts = {"weights": memory.weights, "gradients": memory.gradients, "fp32 master copy": memory.master_weights,
             "optimizer states": memory.optimizer_states}
    per_param = " + ".join(f"{name} {value / n_params:g}" for name, value in parts.items() if value)
    return f"bytes per parameter: {per_param} = {memory.total / n_params:g}"


def check_training_bytes(fn: Any) -> CheckResult:
    """Check ``training_bytes(n_params, dtype, optimizer)`` against ``parallel_lib.model_parallel.memory.training_memory``."""
    shapes = [(1000, "fp16", "adamw"), (124_439_808, "fp16", "adamw"), (1000, "fp32", "adamw"),
              (1000, "bf16", "sgd_momentum"), (1000, "fp32", "sgd"), (1000, "fp16", None), (1000, "fp32", None)]
    cases = [Case(shape, training_memory(*shape).total) for shape in shapes]
    return check_function("training_bytes", fn, "training_bytes", cases, normalise=as_number, compare=same_number,
                          hint=_training_hint)


EXERCISES = [
    Exercise("balanced_device_map", check_balanced_device_map, DEVICE_MAP_STUB, solutions.balanced_device_map),
    Exercise("training_bytes", check_training_bytes, TRAINING_BYTES_STUB, solutions.training_bytes),
]
