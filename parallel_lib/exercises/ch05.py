"""Exercises for chapter 05: memory per device under a plan, and choosing stages and replicas.

Both use the course's standard estimate, ``parallel_lib.model_parallel.memory.training_memory`` for
mixed-precision Adam (16 bytes per parameter, activations left out), so the answers
can be checked exactly; chapter 05 discusses what the estimate leaves out.
"""

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
from parallel_lib.model_parallel.memory import MODEL_SHAPES, GiB, training_memory

__all__ = ["check_bytes_per_device", "check_plan_parallelism", "EXERCISES"]

BYTES_PER_DEVICE_STUB = '''\
def bytes_per_device(n_params, pipeline_stages, data_replicas):
    """Training bytes on each GPU when `data_replicas` copies of the model each run as a pipeline
    of `pipeline_stages` equal stages (mixed-precision Adam: 16 bytes per parameter, no activations)."""
    ...  # your code here
'''

PLAN_STUB = '''\
def plan_parallelism(n_params, gpu_bytes, n_gpus):
    """(pipeline_stages, data_replicas) for training on `n_gpus` GPUs of `gpu_bytes` each, or None if
    the model cannot be trained on them (mixed-precision Adam: 16 bytes per parameter, no activations).

    Use as few pipeline stages as hold one copy of the model, and as many data-parallel
    replicas of that pipeline as the GPUs allow. (1, n) is pure data parallelism.
    """
    ...  # your code here
'''

_MIXED_ADAM = ("fp16", "adamw")


def _total(n_params: int) -> float:
    return training_memory(n_params, *_MIXED_ADAM).total


def _per_device_hint(args: tuple, got: Any) -> str:
    n_params, stages, replicas = args
    if isinstance(got, float) and replicas > 1 and abs(got - _total(n_params) / (stages * replicas)) < 1:
        return ("data-parallel replicas do not share memory: each holds a full copy of the model "
                "(here split over its pipeline stages)")
    return "the model needs 16 bytes per parameter; a pipeline's stages share one copy"


def check_bytes_per_device(fn: Any) -> CheckResult:
    """Check ``bytes_per_device(n_params, pipeline_stages, data_replicas)`` against ``training_memory``."""
    n_7b = MODEL_SHAPES["llama-2-7b"].n_params
    shapes = [(1_000_000_000, 1, 1), (1_000_000_000, 4, 1), (1_000_000_000, 1, 8), (n_7b, 2, 4), (n_7b, 8, 1)]
    cases = [Case(shape, training_memory(shape[0], *_MIXED_ADAM).per_device(shape[1])) for shape in shapes]
    return check_function("bytes_per_device", fn, "bytes_per_device", cases, normalise=as_number,
                          compare=same_number, hint=_per_device_hint)


def _plan(n_params: int, gpu_bytes: float, n_gpus: int) -> Optional[tuple[int, int]]:
    stages = training_memory(n_params, *_MIXED_ADAM).min_devices(gpu_bytes)
    return None if stages > n_gpus else (stages, n_gpus // stages)


def _as_plan(value: Any) -> tuple[int, int]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError("a pair (pipeline_stages, data_replicas), or None")
    return as_int(value[0]), as_int(value[1])


def _compare_plans(expected: Optional[tuple[int, int]], got: Optional[tuple[int, int]]) -> Optional[str]:
    if got == expected:
        return None
    want = "None (it does not fit)" if expected is None else show(expected)
    return f"expected {want}, got {'None' if got is None else show(got)}"


def _plan_hint(args: tuple, got: Any) -> str:
    n_params, gpu_bytes, n_gpus = args
    total = _total(n_params)
    stages = training_memory(n_params, *_MIXED_ADAM).min_devices(gpu_bytes)
    return (f"training needs 16 x {n_params:,} bytes = {total / GiB:.1f} GiB, so one copy needs at least "
            f"ceil({total / GiB:.1f} / {gpu_bytes / GiB:g}) = {stages} GPU(s) as pipeline stages; "
            f"{n_gpus} GPUs then hold {n_gpus // stages} such replica(s)")


def check_plan_parallelism(fn: Any) -> CheckResult:
    """Check ``plan_parallelism(n_params, gpu_bytes, n_gpus)`` against ``training_memory(...).min_devices``."""
    params = {name: shape.n_params for name, shape in MODEL_SHAPES.items()}
    shapes = [(params["gpt2 (124M)"], 16 * GiB, 8), (params["gpt2 (124M)"], 16 * GiB, 1),
              (params["llama-2-7b"], 16 * GiB, 8), (params["llama-2-7b"], 80 * GiB, 8),
              (params["llama-2-13b"], 40 * GiB, 16), (2**30, 16 * GiB, 2), (params["llama-2-70b"], 80 * GiB, 8)]
    cases = [Case(shape, _plan(*shape)) for shape in shapes]
    return check_function("plan_parallelism", fn, "plan_parallelism", cases, normalise=_as_plan,
                          compare=_compare_plans, hint=_plan_hint, none_is_an_answer=True)


EXERCISES = [
    Exercise("bytes_per_device", check_bytes_per_device, BYTES_PER_DEVICE_STUB, solutions.bytes_per_device),
    Exercise("plan_parallelism", check_plan_parallelism, PLAN_STUB, solutions.plan_parallelism),
]
