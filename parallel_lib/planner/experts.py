"""The planner learns expert parallelism: a mixture-of-experts model priced on a dp × tp × pp layout with ``ep``.

A mixture model is the dense decoder :func:`~parallel_lib.planner.layout.price` already prices,
with each block's MLP replaced by ``E`` experts of that MLP's shape (plus ``shared`` experts every
token uses) and a router. So :func:`price_ep` prices the dense model on the layout and adds what
the mixture changes, each from a formula a chapter verified:

- **parameters and model state**: a block holds ``E/ep + shared`` MLPs instead of one, and the
  router (``E · h``). The routed experts have ``dp/ep`` copies (the ``ep`` ranks of a data-parallel
  group split them), everything else ``dp``; ZeRO shards each over its copies (as
  :func:`parallel_lib.cost.moe.moe_memory` does; the parameter counts equal
  :class:`~parallel_lib.cost.moe.MoEShape`'s, tested for Mixtral 8x7B);
- **compute**: a token goes through ``top_k + shared`` MLPs instead of one (FLOPs scale the dense
  compute by the ratio of the block's matrix products);
- **all-to-all**: per mixture block and micro-batch, two all-to-alls forward and two backward of the
  micro-batch's ``tokens · top_k`` rows of ``h`` (:func:`parallel_lib.cost.moe.ep_traffic`), priced with
  the α–β of an all-gather of the same message over ``ep`` ranks (each puts ``(ep-1)/ep`` of it on
  the wire; the calibration has no all-to-all of its own);
- **gradients**: the dense collectives scaled to the replicated parameters, plus the experts'
  over their ``dp/ep`` copies.

Nothing overlaps, as in the dense planner; routing is taken as balanced (the straggler of chapter 12
is on top). :func:`plan_ep` tries every ``ep`` dividing dp and the experts for every layout
:func:`~parallel_lib.planner.search.plan_layouts` would try, and ranks those that fit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Union

from parallel_lib.common.checks import check_int, positive_int
from parallel_lib.cost.moe import ep_traffic
from parallel_lib.cost.zero import zero_memory
from parallel_lib.model_parallel.memory import DTYPE_BYTES
from parallel_lib.planner.calibrate import Calibration
from parallel_lib.pipeline_parallel.microbatch import stage_blocks
from parallel_lib.planner.layout import Layout, Priced, StepCost, dp_collectives, price
from parallel_lib.planner.search import divisors, plan_layouts
from parallel_lib.cost.shape import GPTShape

__all__ = ["Experts", "EPPriced", "EPPlan", "mlp_parameters", "price_ep", "plan_ep"]


@dataclass(frozen=True)
class Experts:
    """The mixture each block's MLP becomes: ``n_experts`` routed, ``top_k`` per token, ``shared`` always used."""

    n_experts: int
    top_k: int
    shared: int = 0

    def __post_init__(self) -> None:
        positive_int("n_experts", self.n_experts)
        check_int("top_k", self.top_k, 1, self.n_experts, hint="a token cannot choose more experts than there are")
        check_int("shared", self.shared, 0)


def mlp_parameters(shape: GPTShape, tp: int = 1) -> int:
    """One MLP's parameters on a tensor-parallel rank: matrices and column biases over ``tp``, the row bias whole."""
    h, f = shape.n_embd, shape.ffn
    matrices = (3 if shape.gated_mlp else 2) * h * f
    return (matrices + ((2 if shape.gated_mlp else 1) * f if shape.bias else 0)) // tp + (h if shape.bias else 0)


@dataclass(frozen=True)
class EPPriced:
    """A mixture model's layout with ``ep``, priced for the busiest rank; seconds split by where they go."""

    dense: Priced                # the same layout of the dense model (one MLP per block)
    ep: int
    params: int                  # parameters on the rank
    expert_params: int           # of them, routed experts (dp/ep copies)
    state_bytes: float
    activation_bytes: float
    compute: float
    all_to_all: float            # the dispatch and combine, forward and backward, every micro-batch and block
    all_to_all_bytes: float      # their messages on the rank per step
    dp_comm: float
    optimizer: float

    @property
    def layout(self) -> Layout:
        return self.dense.layout

    @property
    def name(self) -> str:
        return f"{self.layout.name}, EP{self.ep}" if self.ep > 1 else self.layout.name

    @property
    def memory_bytes(self) -> float:
        return self.state_bytes + self.dense.working_bytes + self.activation_bytes

    @property
    def step_seconds(self) -> float:
        return self.compute + self.all_to_all + self.dp_comm + self.optimizer


def price_ep(layout: Layout, ep: int, shape: GPTShape, experts: Experts, global_batch: int, seq_len: int,
             calibration: Calibration, step_cost: Union[StepCost, str]) -> EPPriced:
    """Memory per device and time per step of ``layout`` with ``ep`` training ``shape`` with mixture MLPs.

    Args:
        layout: the dense layout (dp, tp, pp, ZeRO, schedule, micro-batches).
        ep: expert-parallel ranks, dividing ``layout.dp`` and the experts.
        shape: the dense decoder; its MLP is the shape of one expert.
        experts: the mixture.
        global_batch, seq_len, calibration, step_cost: as :func:`~parallel_lib.planner.layout.price`.

    Raises:
        ValueError: ``ep`` not dividing dp or the experts, or what :func:`~parallel_lib.planner.layout.price` refuses.
    """
    positive_int("ep", ep)
    if layout.dp % ep or experts.n_experts % ep:
        raise ValueError(f"ep={ep} must divide dp={layout.dp} and n_experts={experts.n_experts}: the experts are "
                         "split over ep of a data-parallel group's ranks")
    # no overlap: the experts' own collectives below are added whole, so the dense part's are too
    dense = price(layout, shape, global_batch, seq_len, calibration, step_cost, overlap=False)
    L, width = layout, DTYPE_BYTES[layout.dtype]
    blocks = max(len(b) for b in stage_blocks(shape.n_layer, L.pp))
    mlp = mlp_parameters(shape, L.tp)
    expert_params = blocks * experts.n_experts // ep * mlp
    replicated = dense.params + blocks * ((experts.shared - 1) * mlp + experts.n_experts * shape.n_embd)
    precision = "fp32" if width == 4 else "bf16"
    zero = L.zero if L.dp > 1 else 0
    state = (zero_memory(replicated, L.dp, zero, precision)["total"]
             + zero_memory(expert_params, L.dp // ep, zero if L.dp > ep else 0, precision)["total"])
    # compute: top_k + shared MLPs per token instead of one
    mlp_matmul = (3 if shape.gated_mlp else 2) * shape.n_embd * shape.ffn
    scale = (shape.matmul_parameters() + (experts.top_k + experts.shared - 1) * mlp_matmul) / shape.matmul_parameters()
    # the MLP's activations (its input and inner width) for top_k + shared of them
    activations = dense.activation_bytes * scale
    rows = global_batch // L.dp // L.micro_batches * seq_len // (L.tp if L.sequence_parallel else 1)
    one = ep_traffic(rows, experts.top_k, shape.n_embd, experts.n_experts, ep, width)
    world = L.devices
    link = calibration.link("all_gather", world, L.tp * L.pp * ep)
    a2a = 4 * blocks * L.micro_batches * link.seconds("all_gather", one.row_bytes, ep)
    a2a_bytes = blocks * L.micro_batches * one.message_bytes
    # gradients: the replicated share of the dense collectives, and the experts' over their dp/ep copies
    dp_comm = dense.dp_comm * replicated / dense.params
    if L.dp > ep:
        expert_layout = replace(L, dp=L.dp // ep)
        for kind, (n, nbytes) in dp_collectives(expert_layout, expert_params, blocks).items():
            dp_comm += n * calibration.link(kind, world, L.tp * L.pp * L.dp).seconds(kind, nbytes / n, L.dp // ep)
    sharded = L.zero >= 1  # the optimizer steps on the rank's share of each group's states
    per_param = dense.optimizer / (dense.params / (L.dp if sharded else 1))
    optimizer = per_param * (replicated / (L.dp if sharded else 1) + expert_params / (L.dp // ep if sharded else 1))
    return EPPriced(dense, ep, replicated + expert_params, expert_params, state, activations, dense.compute * scale,
                    a2a if ep > 1 else 0.0, a2a_bytes if ep > 1 else 0.0, dp_comm, optimizer)


@dataclass(frozen=True)
class EPPlan:
    """Every (layout, ep) tried: ``ranked`` fit, fastest first; ``rejected`` do not."""

    ranked: tuple[EPPriced, ...]
    rejected: tuple[EPPriced, ...]

    @property
    def best(self) -> EPPriced:
        if not self.ranked:
            raise ValueError("no layout fits: more devices, more memory per device, or a smaller batch")
        return self.ranked[0]


def plan_ep(shape: GPTShape, experts: Experts, devices: int, memory_per_device: float, global_batch: int,
            seq_len: int, calibration: Calibration, step_cost: Union[StepCost, str], dtype: str = "bf16",
            **search: object) -> EPPlan:
    """Every layout :func:`~parallel_lib.planner.search.plan_layouts` tries for the dense ``shape``, with every ``ep``.

    The dense search runs with unlimited memory (a mixture needs more than its dense model); each of its
    layouts is then priced with each ``ep`` dividing its dp and the experts and kept if it fits in
    ``memory_per_device`` bytes; without a pipeline, with the fewest micro-batches (gradient accumulation)
    that fit, as the dense search does. ``search``: more keywords for :func:`plan_layouts` (``schedules``,
    ``zero_stages``, ``recompute``...).
    """
    search.setdefault("overlap", False)  # as price_ep: no collective hidden, the dense part's nor the experts'
    dense = plan_layouts(shape, devices, float(2**80), global_batch, seq_len, calibration, step_cost, dtype,
                         **search)  # type: ignore[arg-type]
    fits, rejected = [], []
    for candidate in dense.ranked:
        layout = candidate.layout
        counts = divisors(global_batch // layout.dp) if layout.pp == 1 else [layout.micro_batches]
        for ep in divisors(layout.dp):
            if experts.n_experts % ep:
                continue
            for m in counts:
                priced = price_ep(replace(layout, micro_batches=m), ep, shape, experts, global_batch, seq_len,
                                  calibration, step_cost)
                if priced.memory_bytes <= memory_per_device:
                    fits.append(priced)
                    break
            else:
                rejected.append(priced)
    fits.sort(key=lambda p: (p.step_seconds, p.memory_bytes))
    return EPPlan(tuple(fits), tuple(rejected))
