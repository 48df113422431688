"""Exercises for chapter 05: memory per device under a plan, and choosing stages and replicas.

``bytes_per_device`` uses the course's standard estimate (``training_memory``, mixed-precision
Adam, 16 bytes per parameter). ``plan_parallelism`` is handed the planner's own memory test and
is checked against the planner's own answer (``plan(...).layout``, built on
:func:`~parallel_lib.planner.strategy.fewest_stages`), so the chapter, the planner and the
checker cannot disagree.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

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
from parallel_lib.model_parallel.memory import MODEL_SHAPES, training_memory
from parallel_lib.planner.strategy import fewest_stages, plan

__all__ = ["check_bytes_per_device", "check_plan_parallelism", "EXERCISES"]

BYTES_PER_DEVICE_STUB = '''\
def bytes_per_device(n_params, pipeline_stages, data_replicas):
    """Training bytes on each GPU when `data_replicas` copies of the model each run as a pipeline
    of `pipeline_stages` equal stages (mixed-precision Adam: 16 bytes per parameter, no activations)."""
    ...  # your code here
'''

PLAN_STUB = '''\
def plan_parallelism(fits, n_gpus, n_layers):
    """(pipeline_stages, data_replicas) for training on `n_gpus` GPUs, or None if no layout fits.

    `fits(pipeline_stages, data_replicas)` is the planner's memory test: True when `data_replicas`
    copies of the model, each split into `pipeline_stages` stages, fit (training state, and the
    activations of each replica's share of the batch). A stage holds at least one of `n_layers`
    blocks. Among the layouts that fit, choose the one with the smallest pipeline bubble, and
    leave as few GPUs idle as that allows.
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


class _Fits:
    """A memory test handed to the student's function, printed by what it tests."""

    def __init__(self, label: str, test: Callable[[int, int], bool]):
        self.label, self.test = label, test

    def __call__(self, pipeline_stages: int, data_replicas: int) -> bool:
        return bool(self.test(as_int(pipeline_stages), as_int(data_replicas)))

    def __repr__(self) -> str:
        return f"fits[{self.label}]"


def _planner_case(model: str, seq_len: int, batch_size: int, gpu_gib: float, n_gpus: int) -> Case:
    chosen = plan(model, seq_len, batch_size, gpu_gib, n_gpus)  # the chapter's planner: its answer is the key
    label = f"{model}, {batch_size} x {seq_len} tokens, {n_gpus} x {gpu_gib:g} GiB"
    return Case((_Fits(label, chosen.fits), n_gpus, MODEL_SHAPES[model].n_layers), chosen.layout)


def _made_up_case(label: str, test: Callable[[int, int], bool], n_gpus: int, n_layers: int) -> Case:
    fits = _Fits(label, test)
    return Case((fits, n_gpus, n_layers), fewest_stages(fits, n_gpus, n_layers))


def _as_plan(value: Any) -> tuple[int, int]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError("a pair (pipeline_stages, data_replicas), or None")
    return as_int(value[0]), as_int(value[1])


def _compare_plans(expected: Optional[tuple[int, int]], got: Optional[tuple[int, int]]) -> Optional[str]:
    if got == expected:
        return None
    want = "None (nothing fits)" if expected is None else show(expected)
    return f"expected {want}, got {'None' if got is None else show(got)}"


def _plan_hint(args: tuple, got: Any) -> str:
    fits, n_gpus, n_layers = args
    expected = fewest_stages(fits, n_gpus, n_layers)
    if got is None:
        return f"fits{expected} is True: that layout trains"
    if not isinstance(got, tuple):
        return ""
    stages, replicas = got
    if stages > n_layers:
        return f"a stage holds one block at least: {n_layers} blocks make at most {n_layers} stages"
    if stages * replicas > n_gpus:
        return f"{stages} x {replicas} = {stages * replicas} GPUs, but there are {n_gpus}"
    if not fits(stages, replicas):
        return f"fits({stages}, {replicas}) is False: that layout does not fit in memory"
    if expected is not None and stages > expected[0]:
        return (f"fits{expected} is True too, with fewer stages: the bubble (p-1)/(m+p-1) grows with p. "
                f"Ask fits with the replicas a layout really has (n_gpus // stages): more replicas give "
                f"each a smaller share of the batch, hence fewer activations")
    if expected is not None and stages == expected[0] and replicas < expected[1]:
        return f"{n_gpus} GPUs hold {n_gpus // stages} replicas of {stages} stages: the rest sit idle"
    return "the smallest bubble comes from the fewest stages; every GPU left over makes another replica"


def check_plan_parallelism(fn: Any) -> CheckResult:
    """Check ``plan_parallelism(fits, n_gpus, n_layers)`` against the planner's own layout (``plan(...).layout``)."""
    cases = [
        _planner_case("gpt2 (124M)", 1024, 32, 16, 8),
        _planner_case("gpt2-xl (1.5B)", 1024, 64, 80, 1),
        _planner_case("llama-2-7b", 4096, 64, 80, 8),
        _planner_case("llama-2-13b", 2048, 32, 80, 16),
        _made_up_case("needs 3 stages", lambda stages, replicas: stages >= 3, 8, 12),
        _made_up_case("needs 3 stages, only 2 blocks", lambda stages, replicas: stages >= 3, 8, 2),
        _planner_case("llama-2-70b", 4096, 64, 80, 8),
    ]
    return check_function("plan_parallelism", fn, "plan_parallelism", cases, normalise=_as_plan,
                          compare=_compare_plans, hint=_plan_hint, none_is_an_answer=True)


EXERCISES = [
    Exercise("bytes_per_device", check_bytes_per_device, BYTES_PER_DEVICE_STUB, solutions.bytes_per_device),
    Exercise("plan_parallelism", check_plan_parallelism, PLAN_STUB, solutions.plan_parallelism),
]
