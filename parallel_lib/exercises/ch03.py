"""Exercises for chapter 03: a device map that leaves no device idle, one that fits a memory limit,
and the memory of training.

``device_map_under_limit`` accepts any map that keeps layers whole and in order, stays under the
limit on every device and uses as few devices as
:func:`parallel_lib.model_parallel.layer_memory.pack_layer_bytes` (the reference) needs.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from parallel_lib.exercises._core import (
    solution,
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
from parallel_lib.model_parallel.layer_memory import layer_parameters, pack_layer_bytes
from parallel_lib.model_parallel.memory import GiB, training_memory

__all__ = ["check_balanced_device_map", "check_device_map_under_limit", "check_training_bytes", "EXERCISES"]

DEVICE_MAP_STUB = '''\
def balanced_device_map(n_layers, n_devices):
    """{device: [layer indices]} for devices 0 .. n_devices-1: consecutive layers, in order,
    with block sizes that differ by at most one (the ceil(n_layers / n_devices) recipe
    leaves a device idle for 12 layers on 5 devices).
    """
    ...  # your code here
'''

LIMIT_MAP_STUB = '''\
def device_map_under_limit(layer_bytes, capacity):
    """{device: [block indices]} on as few devices as possible, each holding at most `capacity` bytes.

    `layer_bytes` is [embedding, block 0, ..., block n-1, head] in bytes. Blocks stay whole and in
    order (device 0 gets the first ones); the embedding sits on device 0, the head on the last device.
    Raise ValueError if some layer cannot fit on a device at all.
    """
    ...  # your code here
'''

TRAINING_BYTES_STUB = '''\
def training_bytes(n_params, dtype="fp16", optimizer="adamw"):
    """Bytes to train a model of `n_params` parameters, activations not counted.

    `dtype` is "fp32", or "fp16"/"bf16" for mixed precision; `optimizer` is "adamw", "sgd_momentum",
    "sgd", or None for inference. Reason it out from what each one keeps per parameter (section 6
    measured it tensor by tensor); a wrong answer gets a hint.
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


class _Sizes(list):
    """A model's layer sizes, printed by name in a failing case (34 numbers would hide the case)."""

    label = ""

    def __repr__(self) -> str:
        return self.label


def _layer_sizes(model: str, bytes_per_parameter: float) -> list[float]:
    sizes = _Sizes(n * bytes_per_parameter for _, n in layer_parameters(model))
    sizes.label = f"<layers of {model} at {bytes_per_parameter:g} bytes/parameter>"
    return sizes


def _limit_problem(args: tuple, got: dict) -> Optional[str]:
    layer_bytes, capacity = args
    blocks = len(layer_bytes) - 2
    if sorted(got) != list(range(len(got))):
        return f"devices must be 0 .. {len(got) - 1}, got {sorted(got)}"
    order = [i for device in sorted(got) for i in got[device]]
    if order != list(range(blocks)):
        return f"blocks must appear once each, consecutive and in device order; got {show(got)}"
    for device in sorted(got):
        held = sum(layer_bytes[i + 1] for i in got[device])
        held += layer_bytes[0] if device == 0 else 0
        held += layer_bytes[-1] if device == len(got) - 1 else 0
        if held > capacity:
            extra = " (with the embedding)" if device == 0 else " (with the head)" if device == len(got) - 1 else ""
            return f"device {device} holds {held:.4g} bytes{extra} > capacity {capacity:.4g}"
    return None


def _compare_limit_maps(expected: Any, got: Any) -> Optional[str]:
    args, reference = expected
    if isinstance(reference, type):
        return None  # an exception was expected: check_function handles it
    problem = _limit_problem(args, got)
    if problem:
        return problem
    if len(got) > len(reference):
        return f"{len(got)} devices, but {len(reference)} suffice: e.g. {show(reference)}"
    return None


def _limit_hint(args: tuple, got: Any) -> str:
    layer_bytes, capacity = args
    total = sum(layer_bytes)
    if isinstance(got, dict) and len(got) == math.ceil(total / capacity):
        return (f"ceil(total / capacity) = {len(got)} devices assumes the model can be cut anywhere; whole layers "
                "leave gaps, so fill each device in order until the next layer would overflow it")
    return "fill device 0 (embedding first) with layers until the next one would overflow it, then open a device"


def check_device_map_under_limit(fn: Any) -> CheckResult:
    """Check ``device_map_under_limit(layer_bytes, capacity)``: valid, under the limit, no more devices than
    ``pack_layer_bytes`` needs."""
    raw = [([1.0, 1, 1, 1, 1, 0.5], 2.0), ([3.0, 2, 2, 2, 2, 3], 6.0), (_layer_sizes("gpt2 (124M)", 16), 0.8 * GiB),
           (_layer_sizes("llama-2-7b", 2), 16 * GiB), (_layer_sizes("llama-2-7b", 16), 40 * GiB),
           ([1.0, 5, 1, 1], 4.0)]
    cases = []
    for args in raw:
        try:
            reference: Any = pack_layer_bytes(*args)
        except ValueError:
            reference = ValueError
        # the expected value carries the arguments: any map as short as the reference is right
        cases.append(Case(args, reference if isinstance(reference, type) else (args, reference)))
    return check_function("device_map_under_limit", fn, "device_map_under_limit", cases,
                          normalise=_as_device_map, compare=_compare_limit_maps, hint=_limit_hint)


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


# balanced_device_map stays importable (check_balanced_device_map) but is no exercise: chapter 03
# prints get_device_map, its answer.
EXERCISES = [
    Exercise("device_map_under_limit", check_device_map_under_limit, LIMIT_MAP_STUB,
             solution("device_map_under_limit"),
             "Write `device_map_under_limit(layer_bytes, capacity)`: place whole layers, in order, on as few "
             "devices of `capacity` bytes as possible (the embedding on the first, the head on the last). "
             "Why is `ceil(total / capacity)` devices not always enough?"),
    Exercise("training_bytes", check_training_bytes, TRAINING_BYTES_STUB, solution("training_bytes"),
             "Write `training_bytes(n_params, dtype, optimizer)`: the bytes of weights, gradients, master copy "
             "and optimizer states, activations not counted."),
]
