"""Exercises for chapter 05: memory per device under a plan, and choosing stages and replicas.

``bytes_per_device`` uses the course's standard estimate (``training_memory``, mixed-precision
Adam, 16 bytes per parameter). ``plan_parallelism`` is handed the planner's own memory test and
is checked against the planner's own answer (``plan(...).layout``, built on
:func:`~parallel_lib.planner.strategy.fewest_stages`), so the chapter, the planner and the
checker cannot disagree.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from parallel_lib.exercises._core import (
    solution,
    Case,
    CheckResult,
    Exercise,
    as_int,
    as_number,
    check_function,
    failed,
    is_stub,
    passed,
    require_callable,
    stub_result,
    same_number,
    show,
)
from parallel_lib.cost.shape import SHAPES
from parallel_lib.model_parallel.memory import training_memory
from parallel_lib.planner.strategy import fewest_stages, plan

__all__ = ["check_bytes_per_device", "check_plan_parallelism", "check_ring_exchange_order", "replay_blocking",
           "EXERCISES"]

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

EXCHANGE_STUB = '''\
def ring_exchange_order(rank, world_size):
    """The order of `rank`'s two blocking operations when every rank sends a tensor to (rank + 1) %
    world_size and receives one from (rank - 1) % world_size: a list of ("send", peer) and
    ("recv", peer). A blocking send waits until its peer posts the matching receive (NCCL's rule
    for large tensors), so the order must let every rank finish, for any world_size >= 2.
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
    n_7b = SHAPES["llama-2-7b"].parameters()
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
    return Case((_Fits(label, chosen.fits), n_gpus, SHAPES[model].n_layer), chosen.layout)


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


Op = tuple[str, int]


def _as_ops(value: Any) -> list[Op]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError('a list like [("send", 1), ("recv", 2)]')
    ops = []
    for op in value:
        if not (isinstance(op, (tuple, list)) and len(op) == 2 and op[0] in ("send", "recv")):
            raise TypeError(f'a list of ("send", peer) and ("recv", peer) pairs, not {show(op, 40)}')
        ops.append((op[0], as_int(op[1])))
    return ops


def replay_blocking(orders: list[list[Op]]) -> Optional[str]:
    """None if every rank finishes when each send waits for its receive (and the reverse); else who waits on whom."""
    position = [0] * len(orders)
    progress = True
    while progress:
        progress = False
        for rank, ops in enumerate(orders):
            if position[rank] == len(ops):
                continue
            kind, peer = ops[position[rank]]
            partner = orders[peer] if 0 <= peer < len(orders) else []
            wanted = ("recv" if kind == "send" else "send", rank)
            if position[peer] < len(partner) and partner[position[peer]] == wanted:
                position[rank] += 1
                position[peer] += 1
                progress = True
    stuck = [f"rank {r} waits in {ops[position[r]][0]}({ops[position[r]][1]})"
             for r, ops in enumerate(orders) if position[r] < len(ops)]
    return "; ".join(stuck) or None


def check_ring_exchange_order(fn: Any) -> CheckResult:
    """Run every rank's order through :func:`replay_blocking` for 2 to 6 ranks: the right messages, no deadlock."""
    require_callable(fn, "ring_exchange_order")
    if is_stub(fn):
        return stub_result("ring_exchange_order", "ring_exchange_order")
    for world_size in range(2, 7):
        orders = []
        for rank in range(world_size):
            label = f"ring_exchange_order({rank}, {world_size})"
            try:
                ops = _as_ops(fn(rank, world_size))
            except Exception as error:  # the student's bug, reported with its case
                return failed("ring_exchange_order", label, f"{type(error).__name__}: {error}")
            wanted = sorted([("send", (rank + 1) % world_size), ("recv", (rank - 1) % world_size)])
            if sorted(ops) != wanted:
                return failed("ring_exchange_order", label, f"expected the two operations {wanted} in some order, "
                              f"got {ops}", "send to the right neighbour, receive from the left one")
            orders.append(ops)
        stuck = replay_blocking(orders)
        if stuck:
            first = {ops[0][0] for ops in orders}
            hint = ("every rank sends first, so every rank waits for a receive nobody posts" if first == {"send"}
                    else "every rank receives first, so nobody sends" if first == {"recv"}
                    else "one rank that receives first breaks the cycle of waiting sends")
            return failed("ring_exchange_order", f"world_size={world_size}", f"deadlock: {stuck}", hint)
    return passed("ring_exchange_order", "5 ring sizes (2 to 6 ranks) without a deadlock")


EXERCISES = [
    Exercise("bytes_per_device", check_bytes_per_device, BYTES_PER_DEVICE_STUB, solution("bytes_per_device"),
             "Write `bytes_per_device(n_params, pipeline_stages, data_replicas)`: the training bytes on each GPU "
             "of `data_replicas` copies of a `pipeline_stages`-stage pipeline (16 bytes per parameter)."),
    Exercise("plan_parallelism", check_plan_parallelism, PLAN_STUB, solution("plan_parallelism"),
             "Write `plan_parallelism(fits, n_gpus, n_layers)`: given the planner's memory test, choose the layout "
             "with the smallest bubble that fits. The checker compares with the planner's own pick."),
    Exercise("ring_exchange_order", check_ring_exchange_order, EXCHANGE_STUB, solution("ring_exchange_order"),
             "Repair a deadlock. Every rank runs `dist.send(x, (rank + 1) % N)` and then "
             "`dist.recv(y, (rank - 1) % N)`: under NCCL's rule a large send waits for its receive, and the "
             "ring hangs. Write `ring_exchange_order(rank, world_size)`, an order of the same two operations "
             "that lets every rank finish for any N >= 2 (without `batch_isend_irecv`)."),
]
