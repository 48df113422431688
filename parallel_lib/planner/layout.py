"""One layout of a training job over a dp × tp × pp × cp grid, priced: memory per device and time per step.

This is the course's one pricing: chapter 10's search (:mod:`~parallel_lib.planner.search`) and chapter
05's named strategies (:mod:`~parallel_lib.planner.strategy`: model parallelism is the schedule
:func:`sequential`) both call :func:`price`, so the two can no longer disagree about a layout (they did
about a pipeline stage's share of the model: chapter 05 gave each stage Ψ/p, this counts its blocks and
the embedding). Every number comes from code a chapter verified, not from a new formula:

- parameters per rank: :func:`parallel_lib.tensor_parallel.cost.shard_parameters` (chapter 07) for a
  block and the embedding, the stages split by ``split_layers``'s rule (chapter 04: the first stages
  take one block more), the tied head's copy on the last stage (chapter 05's DP×PP run holds one);
- model state per rank (:func:`state_memory`): :func:`parallel_lib.cost.zero.zero_memory` (chapter 06)
  of those parameters (what a rank keeps between steps, the tensor census); ZeRO-3 shards as FSDP2's
  ``fully_shard`` does, each tensor's rows in equal chunks, the last ones padded
  (:func:`~parallel_lib.cost.zero.fsdp_shard_numel`: GPT-2 XL at 1,024 ranks holds 1.22 × Ψ/N, which
  the dry run :mod:`parallel_lib.planner.dry_run` measures with FSDP2 and DTensor); under ZeRO-3 also the working set
  :func:`~parallel_lib.cost.zero.zero3_working_set`, what the rank gathers while it computes (the
  embeddings and head, a block, the prefetched next block, and their whole gradients);
- activations: :func:`parallel_lib.cost.activation.activation_bytes` (chapter 03's formula with chapter 07's
  tensor and sequence parallelism and full recomputation), times the schedule's peak in-flight micro-batches from the simulator (chapter 08);
- time: compute from the calibration (:mod:`parallel_lib.planner.calibrate`) and
  :func:`~parallel_lib.tensor_parallel.cost.training_flops` (recomputation: the blocks' forward once
  more); tensor-parallel collectives from :func:`~parallel_lib.tensor_parallel.cost.step_collectives`
  (recomputation: the recomputed forward's all-reduces too, 6 per block instead of 4); the pipeline replayed by
  :func:`parallel_lib.pipeline_parallel.simulator.replay` with those costs and the send time;
  then the data-parallel collectives of the ZeRO stage (:func:`dp_collectives`: ZeRO-2 reduce-scatters
  every micro-batch's gradients, ZeRO-3 gathers the parameters twice per micro-batch) and the
  optimizer on the rank's share.

- context parallelism (chapter 11, ``cp`` > 1): each of the cp ranks holds s/cp of every
  sequence (zig-zag, so the causal work is even), so its activations, FLOPs, tensor-parallel
  collectives and pipeline sends are those of s/cp tokens (attention's s² FLOPs too: a rank's
  s/cp queries meet all s keys). Its traffic is ring attention's per block and micro-batch,
  :func:`parallel_lib.context_parallel.cost.cp_wire_bytes` of the key/value heads a tp rank holds
  (grouped-query attention sends fewer than the queries use); a ring step's exchange is posted
  before its compute, so only what a step's transfer takes beyond the step's attention shows
  (:func:`cp_seconds`; forward, backward at twice the work, and the last dK/dV step home, never
  hidden). The cp ranks hold the same parameters: the gradients reduce, and ZeRO shards, over
  dp · cp ranks.

What overlaps (``overlap``, :func:`exposed_seconds`): engines at scale hide data-parallel
communication behind compute. DDP's buckets (and Megatron's, and FSDP's reduce-scatters) start as
the backward pass fills them, so a gradient reduction shows only where it outlasts the backward of
the micro-batch it follows, and at least its last bucket; ZeRO-3 (FSDP) prefetches the next layer
group's all-gather while the current one computes, so only the first gather of each pass, and what
outlasts the compute, shows. The pieces are the layer groups (one per block and one for the rest),
or ``grad_collectives`` buckets when the layout names more than one. What never overlaps: the
tensor-parallel all-reduces (each layer's output waits for them: on the critical path), ZeRO-1/2's
all-gather of the updated parameters after the optimizer step, and the tied embedding's all-reduce.
``overlap=False`` is what the course's own engines do (ZeroEngine reduces its flat groups after the
backward pass, ZeRO-3 gathers without prefetch unless asked): the default for a calibration
measured on this machine; published GPU figures default to ``overlap=True``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Optional, Union

from parallel_lib.common.checks import check_choice, check_number, positive_int
from parallel_lib.context_parallel.cost import GRAD_ITEMSIZE, cp_wire_bytes, ring_step_flops
from parallel_lib.cost.alpha_beta import ring_wire_bytes, wire_bytes
from parallel_lib.cost.zero import fsdp_shard_numel, zero3_working_set, zero_collectives, zero_memory
from parallel_lib.model_parallel.memory import DTYPE_BYTES
from parallel_lib.pipeline_parallel.generators import interleaved_1f1b
from parallel_lib.common.timeline import Event
from parallel_lib.pipeline_parallel.microbatch import stage_blocks
from parallel_lib.pipeline_parallel.schedule import Action, Schedule, make_schedule, stage_lane
from parallel_lib.pipeline_parallel.simulator import bubbles, peak_in_flight, replay
from parallel_lib.planner.calibrate import AlphaBeta, Calibration
from parallel_lib.planner.hardware import group_span
from parallel_lib.cost.shape import GPTShape
from parallel_lib.cost.activation import activation_bytes
from parallel_lib.tensor_parallel.cost import shard_parameters, step_collectives

__all__ = ["Layout", "StepCost", "Priced", "rank_parameters", "stage_parameter_shapes", "state_memory",
           "dp_collectives", "p2p_bytes", "MemoryCost", "price_memory", "cp_seconds", "exposed_seconds", "price",
           "SCHEDULES", "sequential"]

# "sequential": one micro-batch in the pipeline at a time (chapter 03's model parallelism, accumulating)
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "sequential")


def sequential(p: int, m: int) -> Schedule:
    """Model parallelism with gradient accumulation as a schedule: every rank runs F(i), B(i), then micro-batch i+1.

    A rank's forward of micro-batch i + 1 waits for its backward of i, which waits for every later
    stage's: one micro-batch is in the pipeline at a time (chapter 03), so a rank keeps one micro-batch's
    activations and the simulator finds the bubble ``(p − 1)/p`` of a step with equal stages.
    """
    actions = tuple(a for i in range(positive_int("m", m)) for a in (Action("F", i), Action("B", i)))
    return Schedule("sequential", positive_int("p", p), m, tuple(actions for _ in range(p)))


def _schedule(name: str, p: int, m: int, v: int) -> Schedule:
    if name == "interleaved":
        return interleaved_1f1b(p, m, v)
    return sequential(p, m) if name == "sequential" else make_schedule(name, p, m)


@dataclass(frozen=True)
class Layout:
    """How ``dp · tp · pp · cp`` ranks train one model; ``micro_batches`` per replica and step.

    With ``pp == 1`` the micro-batches run one after another (gradient accumulation); with
    ``pp > 1`` they fill the pipeline in ``schedule`` order (``virtual`` model stages per rank
    for "interleaved").
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0                    # ZeRO stage over the dp ranks (0: plain data parallelism)
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    virtual: int = 1
    micro_batches: int = 1
    recompute: bool = False
    dtype: str = "fp32"              # "fp32", or "bf16"/"fp16" for mixed precision
    grad_collectives: int = 1        # calls the gradient reduction takes: 1 flat bucket, or one per tensor
    cp: int = 1                      # context parallelism: ranks sharing each sequence (ring attention, zig-zag)

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "virtual", "micro_batches", "grad_collectives", "cp"):
            positive_int(name, getattr(self, name))
        check_choice("zero", self.zero, (0, 1, 2, 3))
        check_choice("schedule", self.schedule, SCHEDULES)
        check_choice("dtype", self.dtype, sorted(DTYPE_BYTES))
        if (self.virtual > 1) != (self.schedule == "interleaved" and self.pp > 1):
            raise ValueError(f"virtual > 1 goes with schedule='interleaved' and pp > 1, got virtual={self.virtual}, "
                             f"schedule={self.schedule!r}, pp={self.pp}")

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def replicas(self) -> int:
        """Ranks holding the same parameters, whose gradients are reduced together: dp · cp."""
        return self.dp * self.cp

    @property
    def name(self) -> str:
        parts = [f"{k}{v}" for k, v in (("DP", self.dp), ("TP", self.tp), ("PP", self.pp), ("CP", self.cp))
                 if v > 1] or ["1 device"]
        extra = [f"ZeRO-{self.zero}"] if self.zero and self.replicas > 1 else []
        extra += ["SP"] if self.sequence_parallel and self.tp > 1 else []
        if self.pp > 1:
            extra.append(f"{self.schedule}{f' v={self.virtual}' if self.virtual > 1 else ''} m={self.micro_batches}")
        elif self.micro_batches > 1:
            extra.append(f"accumulate {self.micro_batches}")
        extra += ["recompute"] if self.recompute else []
        return "×".join(parts) + (" " + ", ".join(extra) if extra else "")

    def schedule_object(self):  # type: ignore[no-untyped-def]
        """The simulator's schedule of this pipeline (chapter 08's generators, or :func:`sequential`)."""
        return _schedule(self.schedule, self.pp, self.micro_batches, self.virtual)


@dataclass(frozen=True)
class StepCost:
    """One rank's compute: ``fixed`` seconds per block (or embedding+head) and micro-batch pass, plus FLOPs / rate.

    ``optimizer`` is the seconds of one AdamW step over the whole model on one rank alone; a rank
    holding a share of the optimizer states takes that share of it. ``forward`` is the share of a
    pass that the forward takes: 1/3 where compute is FLOPs (a backward does twice a forward's
    products), measured where it is not (a small model on a CPU, where every operation's dispatch
    costs as much forward as backward: 0.50 for tiny GPT-2 here). Measured by
    :func:`parallel_lib.planner.model_step.fit_step_cost`; for published GPUs, fixed 0, the peak rate, 1/3.

    Raises:
        ValueError: a cost that is not a finite number, a negative ``fixed`` or ``optimizer`` (a negative
            time would rank its layout best), a rate that is not > 0, or a ``forward`` share outside (0, 1).
    """

    fixed: float
    flops_per_second: float
    optimizer: float = 0.0
    forward: float = 1 / 3

    def __post_init__(self) -> None:
        check_number("fixed", self.fixed, 0.0, hint="seconds per block and micro-batch; 0 for published peaks")
        check_number("flops_per_second", self.flops_per_second, 0.0, strict=True)
        check_number("optimizer", self.optimizer, 0.0, hint="seconds of one optimizer step")
        check_number("forward", self.forward, 0.0, strict=True, hint="the forward's share of a forward + backward")
        if self.forward >= 1:
            raise ValueError(f"forward must be < 1 (the forward's share of a forward + backward), got "
                             f"forward={self.forward!r}")


def _block_and_rest(shape: GPTShape, tp: int) -> tuple[int, int, int]:
    """(one block's, the first stage's extra, the last stage's extra) parameters on a tp rank (one stage: both)."""
    shard_parameters(shape, tp)  # checks that tp divides the heads and the vocabulary
    outer = shape.outer_parameters(tp)
    return shape.block_parameters(tp), outer["embedding"], outer["final_norm"] + outer["head"]


def rank_parameters(shape: GPTShape, tp: int = 1, pp: int = 1) -> list[int]:
    """Parameters each pipeline stage's rank holds; with a tied head the last stage keeps its own copy of it."""
    block, embedding, last = _block_and_rest(shape, tp)
    out = [len(b) * block for b in stage_blocks(shape.n_layer, pp)]
    out[0] += embedding
    out[-1] += last + (shape.vocab_size * shape.n_embd // tp if pp > 1 and shape.tied_head else 0)
    return out


def stage_parameter_shapes(shape: GPTShape, tp: int = 1, pp: int = 1) -> list[list[tuple[int, ...]]]:
    """The parameter shapes each pipeline stage's tp rank holds: :func:`rank_parameters`, tensor by tensor.

    Raises:
        ValueError: ``tp`` does not divide the heads, key/value heads or vocabulary; ``pp`` above the blocks.
    """
    outer, block = shape.outer_shapes(tp), shape.block_shapes(tp)
    stages = [block * len(b) for b in stage_blocks(shape.n_layer, pp)]
    stages[0] = outer["embedding"] + stages[0]
    tied_copy = outer["embedding"][:1] if pp > 1 and shape.tied_head else []
    stages[-1] = stages[-1] + outer["final_norm"] + outer["head"] + tied_copy
    return stages


@lru_cache(maxsize=1024)
def _fsdp_stage_numel(shape: GPTShape, tp: int, pp: int, replicas: int) -> tuple[int, ...]:
    return tuple(fsdp_shard_numel(shapes, replicas) for shapes in stage_parameter_shapes(shape, tp, pp))


def state_memory(shape: GPTShape, layout: Layout) -> list[dict[str, float]]:
    """Model state bytes each pipeline stage's rank keeps between steps: parameters, gradients, optimizer states.

    :func:`~parallel_lib.cost.zero.zero_memory` of :func:`rank_parameters` over the ``dp · cp``
    replicas, in the layout's precision (fp32: 4 + 4 + 8 bytes per parameter; 16-bit: 2 + 2 + 12).
    ZeRO-3 shards as FSDP2 does: each tensor's rows in ``replicas`` equal chunks, padded, so a rank
    holds :func:`~parallel_lib.cost.zero.fsdp_shard_numel` of its stage's shapes, not ``Ψ / N`` (its
    gradients and optimizer states follow its shards). ZeRO-1/2's flat groups pad less than an
    element per group and rank: ``Ψ / N``.

    Returns:
        per stage, ``{"params", "grads", "optimizer", "total"}`` in bytes.

    Raises:
        ValueError: ``tp`` does not divide the heads, key/value heads or vocabulary; ``pp`` above the blocks.
    """
    precision = "fp32" if DTYPE_BYTES[layout.dtype] == 4 else "bf16"
    n = layout.replicas
    zero = layout.zero if n > 1 else 0
    if zero == 3:  # the padded shard stands for n times itself: zero_memory divides by n again
        return [zero_memory(k * n, n, 3, precision) for k in _fsdp_stage_numel(shape, layout.tp, layout.pp, n)]
    return [zero_memory(p, n, zero, precision) for p in rank_parameters(shape, layout.tp, layout.pp)]


def dp_collectives(layout: Layout, params: int, blocks: int) -> dict[str, tuple[int, float]]:
    """One step's collectives of a rank over its dp (· cp) group: ``{collective: (calls, message bytes)}``.

    :func:`~parallel_lib.cost.zero.zero_collectives` of the rank's ``params`` in the layout's dtype,
    as flat groups: ``grad_collectives`` of them at ZeRO-0 (chapter 07's TP × DP all-reduces each
    tensor: a latency per call), one at ZeRO-1/2, one per block plus one for the rest at ZeRO-3;
    ZeRO-2 reduce-scatters once per micro-batch and ZeRO-3 gathers twice per micro-batch. Empty
    without data parallelism.
    """
    if layout.replicas == 1:
        return {}
    n = layout.grad_collectives if layout.zero == 0 else blocks + 1 if layout.zero == 3 else 1
    grad_bytes = params * DTYPE_BYTES[layout.dtype]
    return zero_collectives([grad_bytes / n] * n, layout.zero, layout.micro_batches)


def p2p_bytes(boundary_bytes: float, stages: int, virtual: int = 1) -> float:
    """Bytes the busiest pipeline rank sends per step: its stages' outputs forward, their inputs' gradients back.

    ``boundary_bytes`` is one step's hidden states at one stage boundary (every micro-batch's); a model
    stage sends forward unless it is the last and backward unless it is the first, and a rank holds
    ``virtual`` model stages (``s``, ``s + p``, ...: interleaved). So an inner rank sends 2 · virtual
    boundaries, a pipeline's end ranks one fewer, one stage nothing.

    Raises:
        ValueError: ``stages`` or ``virtual`` not an int >= 1, or ``boundary_bytes`` below 0.
    """
    check_number("boundary_bytes", boundary_bytes, 0.0)
    p, v = positive_int("stages", stages), positive_int("virtual", virtual)
    last = p * v - 1
    return boundary_bytes * max(sum((s > 0) + (s < last) for s in range(j, p * v, p)) for j in range(p))


@dataclass(frozen=True)
class Priced:
    """A layout's predictions for the busiest rank; seconds split by where they go."""

    layout: Layout
    params: int                  # parameters on the busiest rank
    state_bytes: float           # parameters + gradients + optimizer states between steps (ZeRO formula)
    activation_bytes: float      # peak kept for backward
    in_flight: float             # micro-batches' activations held at the peak (schedule's figure)
    compute: float               # forward + backward of every micro-batch, bubbles included
    tp_comm: float               # inside compute: the tensor-parallel collectives
    dp_comm: float               # data-parallel collectives not hidden behind compute (without overlap: all)
    optimizer: float
    bubble: float                # the simulator's (pipeline only)
    working_bytes: float = 0.0   # ZeRO-3: gathered parameters and their whole gradients while computing
    cp_comm: float = 0.0         # inside compute: ring attention's transfers that its compute did not hide
    dp_hidden: float = 0.0       # data-parallel collectives hidden behind the backward (buckets) or forward (prefetch)
    pp_comm: float = 0.0         # inside compute: the pipeline's sends of the busiest rank (the simulator places them)
    sent: dict = field(default_factory=dict, compare=False)  # bytes the busiest rank sends per step, by group:
    #                              "dp" (gradients, ZeRO's gathers), "tp", "cp", "pp" (hand-overs),
    #                              "embedding" (the tied copy's gradient between the first and last stage)

    @property
    def sent_bytes(self) -> float:
        """Bytes the busiest rank sends per step, every group together (ring algorithm)."""
        return sum(self.sent.values())

    @property
    def comm_seconds(self) -> float:
        """Every collective's and send's seconds, hidden or not: ``dp_comm + dp_hidden + tp_comm + cp_comm +
        pp_comm``."""
        return self.dp_comm + self.dp_hidden + self.tp_comm + self.cp_comm + self.pp_comm

    @property
    def memory_bytes(self) -> float:
        return self.state_bytes + self.working_bytes + self.activation_bytes

    @property
    def step_seconds(self) -> float:
        return self.compute + self.dp_comm + self.optimizer


def _flops(shape: GPTShape, blocks: int, rows: int, seq: int, head: bool) -> float:
    """Forward + backward FLOPs of ``blocks`` blocks (and the head) on ``rows`` sequences: training_flops' terms."""
    block = 6 * rows * seq * blocks * shape.matmul_parameters() + 12 * rows * seq * seq * blocks * shape.n_embd
    return block + (6 * rows * seq * shape.n_embd * shape.vocab_size if head else 0.0)


@lru_cache(maxsize=4096)
def _simulated(name: str, p: int, m: int, v: int, ratios: tuple, comm: float,
               forward: float = 1 / 3) -> tuple[float, float]:
    """(step time, bubble) of the schedule with ``forward`` of each stage's cost (ratios) the forward, the rest
    the backward."""
    schedule = _schedule(name, p, m, v)
    costs = (forward, 1 - forward) if len(ratios) == 1 else [(r * forward, r * (1 - forward)) for r in ratios]
    # the generators' schedules are valid by construction (tests/test_schedules.py): replay without validating
    events = [Event(stage_lane(j), a.event_kind, a.micro_batch, start, end)
              for j, a, start, end in replay(schedule, costs, comm)]
    step, _, bubble, _ = bubbles(events, p)
    return step, bubble


@lru_cache(maxsize=4096)
def _in_flight(name: str, p: int, m: int, v: int) -> float:
    return max(peak_in_flight(_schedule(name, p, m, v)))


def _collective_seconds(calls: dict, cal: Calibration, world: int, group: int, span: int,
                        inside_step: bool = False) -> float:
    return sum(n * cal.link(kind, world, span, inside_step).seconds(kind, nbytes / max(n, 1), group)
               for kind, (n, nbytes) in calls.items())


def exposed_seconds(comm: float, compute: float, pieces: int) -> float:
    """Seconds of ``comm`` that ``compute`` does not hide, when both come in ``pieces`` equal parts in turn.

    Piece k of the communication can start once piece k of the compute has made it (a bucket of
    gradients), or must end before piece k + 1 computes (a prefetched layer group); on one link the
    pieces run one after another. Then one piece always shows (the last bucket, the first gather),
    and the rest shows only where it outlasts the compute: ``max(comm / pieces, comm − compute ·
    (pieces − 1) / pieces)``. One piece hides nothing.

    Raises:
        ValueError: a negative time, or ``pieces`` not an int >= 1.
    """
    check_number("comm", comm, 0.0, hint="seconds of communication")
    check_number("compute", compute, 0.0, hint="seconds of compute it may hide behind")
    n = positive_int("pieces", pieces)
    return max(comm / n, comm - compute * (n - 1) / n)


def _exposed_dp(layout: Layout, seconds: dict[str, float], forward: float, backward: float, pieces: int) -> float:
    """The data-parallel collectives' ``seconds`` (by kind, a whole step's) that the stage's compute does not hide.

    ZeRO-0/1 reduce once, behind the last micro-batch's ``backward``; ZeRO-2 reduce-scatters behind
    each micro-batch's backward; ZeRO-3 gathers behind each forward (prefetch) and gathers again and
    reduce-scatters behind each backward. ZeRO-1/2's all-gather after the optimizer step shows whole.
    """
    m, gather = layout.micro_batches, seconds.get("all_gather", 0.0)
    if layout.zero <= 1:
        return exposed_seconds(seconds.get("all_reduce", 0.0) + seconds.get("reduce_scatter", 0.0), backward,
                               pieces) + gather
    if layout.zero == 2:
        return m * exposed_seconds(seconds["reduce_scatter"] / m, backward, pieces) + gather
    one_pass = gather / (2 * m)  # ZeRO-3: the layer groups gathered once for a forward, once for a backward
    return m * (exposed_seconds(one_pass, forward, pieces)
                + exposed_seconds(one_pass + seconds["reduce_scatter"] / m, backward, pieces))


def cp_seconds(shape: GPTShape, micro_batch: int, seq_len: int, tp: int, cp: int, flops_per_second: float,
               link: AlphaBeta, itemsize: int) -> float:
    """Seconds ring attention's transfers add to one block's forward and backward on one micro-batch.

    Per ring step the exchange (one K and one V block of the tp rank's key/value heads) is posted
    before the step's attention (:func:`~parallel_lib.context_parallel.cost.ring_step_flops` of its
    query heads at ``flops_per_second``), so a step shows only ``max(0, transfer − compute)``:
    cp − 1 forward steps, cp − 1 backward steps (the K/V block and the fp32 dK/dV accumulator,
    behind twice the compute), then the last dK/dV step home with nothing to hide behind. The bytes
    add up to :func:`~parallel_lib.context_parallel.cost.cp_wire_bytes`.

    Raises:
        ValueError: sizes that are not positive ints, ``seq_len`` not divisible by ``cp``.
    """
    if cp == 1:
        return 0.0
    heads, head_dim = shape.n_head // tp, shape.n_embd // shape.n_head
    kv_heads = max(1, (shape.kv_heads or shape.n_head) // tp)        # fewer than tp key/value heads: copies
    wire = cp_wire_bytes("ring", micro_batch, kv_heads, seq_len, head_dim, cp, itemsize)
    kv = wire.forward / (cp - 1)                                      # one step's K and V block
    dkv = kv / itemsize * GRAD_ITEMSIZE                              # one step's dK and dV accumulator
    compute = ring_step_flops(micro_batch, heads, seq_len, head_dim, cp) / flops_per_second
    forward = max(0.0, link.seconds("send", kv, 2) - compute)
    backward = max(0.0, link.seconds("send", kv + dkv, 2) - 2 * compute)
    return (cp - 1) * (forward + backward) + link.seconds("send", dkv, 2)


@dataclass(frozen=True)
class MemoryCost:
    """A layout's memory on its busiest pipeline rank, the part of :class:`Priced` a memory test needs."""

    busiest: int                 # the pipeline stage whose rank holds the most
    params: int                  # parameters on that rank
    state_bytes: float           # parameters + gradients + optimizer states between steps
    working_bytes: float         # ZeRO-3: gathered parameters and their whole gradients while computing
    activation_bytes: float      # peak kept for backward: one micro-batch's times ``in_flight``
    in_flight: float             # micro-batches' activations held at the peak (schedule's figure)

    @property
    def memory_bytes(self) -> float:
        return self.state_bytes + self.working_bytes + self.activation_bytes


def price_memory(layout: Layout, shape: GPTShape, global_batch: int, seq_len: int,
                 attention_scores: bool = False) -> MemoryCost:
    """The memory half of :func:`price`, without simulating a step (what a search's memory test asks first).

    Raises:
        ValueError: as :func:`price`.
    """
    L, width = layout, DTYPE_BYTES[layout.dtype]
    if seq_len % (2 * L.cp):
        raise ValueError(f"seq_len={seq_len} must be divisible by 2·cp = {2 * L.cp} (two chunks per cp rank, "
                         "zig-zag)")
    seq_len //= L.cp  # the tokens of a sequence one rank holds
    rows = global_batch // L.dp
    if global_batch % L.dp or rows % L.micro_batches:
        raise ValueError(f"global_batch={global_batch} must split into dp={L.dp} replicas of "
                         f"micro_batches={L.micro_batches} equal micro-batches")
    mb = rows // L.micro_batches
    params = rank_parameters(shape, L.tp, L.pp)
    blocks = [len(b) for b in stage_blocks(shape.n_layer, L.pp)]  # the stages the runtime builds
    states = [state["total"] for state in state_memory(shape, L)]
    working = [0.0] * L.pp  # what a ZeRO-3 rank holds whole while it computes: its gathered working set
    if L.zero == 3 and L.replicas > 1:
        block = _block_and_rest(shape, L.tp)[0]
        working = [zero3_working_set([block] * b, p - b * block, True, width, width)["total"]
                   for p, b in zip(params, blocks)]
    busiest = max(range(L.pp), key=lambda s: states[s] + working[s])
    # activations of one micro-batch on the busiest stage (the 16-bit formulas, scaled to the dtype)
    stage_shape = replace(shape, n_layer=max(blocks))
    acts = activation_bytes(mb, seq_len, stage_shape, L.tp, L.sequence_parallel, attention_scores,
                            recompute=L.recompute)
    acts *= width / 2
    in_flight = _in_flight(L.schedule, L.pp, L.micro_batches, L.virtual) if L.pp > 1 else 1.0
    return MemoryCost(busiest, params[busiest], states[busiest], working[busiest], acts * in_flight, in_flight)


def price(layout: Layout, shape: GPTShape, global_batch: int, seq_len: int, calibration: Calibration,
          step_cost: Union[StepCost, str], attention_scores: bool = False, overlap: Optional[bool] = None) -> Priced:
    """Memory per device and time per step of ``layout`` training ``shape`` on ``global_batch`` sequences.

    ``overlap``: hide data-parallel communication behind compute as DDP's buckets and ZeRO-3's
    prefetch do (module docstring); ``False``: add every collective's time, as the course's engines
    run them; ``None`` (default): ``True`` for a calibration of published GPU figures (nodes of
    ``gpus_per_node``), ``False`` for one measured on this machine.

    Raises:
        ValueError: a batch that does not split into dp replicas of ``micro_batches`` micro-batches,
            a tp that does not divide the heads and vocabulary, or pp larger than the blocks.

    ``step_cost``: a :class:`StepCost` of one rank alone, or the key of one the calibration holds.
    """
    L, world, width = layout, layout.devices, DTYPE_BYTES[layout.dtype]
    memory = price_memory(layout, shape, global_batch, seq_len, attention_scores)
    full_seq, seq_len = seq_len, seq_len // L.cp     # from here on: the tokens of a sequence one rank holds
    mb = global_batch // L.dp // L.micro_batches
    params = rank_parameters(shape, L.tp, L.pp)
    blocks = [len(b) for b in stage_blocks(shape.n_layer, L.pp)]  # the stages the runtime builds
    busiest = memory.busiest

    # compute per micro-batch and stage: the calibrated rank, slowed by the ranks sharing its cores
    if isinstance(step_cost, str):
        step_cost = StepCost(*calibration.step_cost(step_cost, world))
    else:  # the cost of one rank alone, slowed as the calibration's matmul rate slows with more ranks per core
        slow = calibration.ranks[min(calibration.ranks)].flops_per_second / calibration.at(world).flops_per_second
        step_cost = StepCost(step_cost.fixed * slow, step_cost.flops_per_second / slow, step_cost.optimizer * slow,
                             step_cost.forward)
    # which link each group crosses: the runtime's mesh order, tp fastest (hardware.group_span)
    sizes = dict(tp=L.tp, cp=L.cp, pp=L.pp, dp=L.dp)
    tp_span, pp_span = group_span("tp", sizes), group_span("pp", sizes)
    cp_link = calibration.link("send", world, group_span("cp", sizes))
    costs, passes, tp_total, cp_total, tp_sent = [], [], 0.0, 0.0, 0.0
    for s, b in enumerate(blocks):
        head = s == L.pp - 1
        # the attention term of s/cp queries on all s keys: 1/cp of the whole sequence's
        flops = _flops(shape, b, mb, full_seq, head) / L.tp / L.cp
        units = b + (1 if s == 0 else 0) * 0.5 + (0.5 if head else 0)
        base = step_cost.fixed * units + flops / step_cost.flops_per_second
        share = step_cost.forward  # the forward's part of a pass (1/3 in FLOPs; measured on this machine)
        # recomputation runs the blocks' forward once more in the backward (not the embedding's, not the head's)
        again = share * (step_cost.fixed * b + _flops(shape, b, mb, full_seq, False) / L.tp / L.cp
                         / step_cost.flops_per_second) if L.recompute else 0.0
        passes.append((base * share, base * (1 - share) + again))
        seconds = base + again
        # recomputed blocks issue their forward's collectives again (2 all-reduces per block; SP: its gathers)
        calls = step_collectives(replace(shape, n_layer=b), mb, seq_len, L.tp, L.sequence_parallel, width,
                                 recompute=L.recompute)
        # between the layers of a step: a tp pair's calls as the calibration timed them inside real steps
        tp_seconds = _collective_seconds(calls, calibration, world, L.tp, tp_span, inside_step=True)
        tp_total = max(tp_total, tp_seconds)
        tp_sent = max(tp_sent, wire_bytes(calls, L.tp))
        cp_block = b * cp_seconds(shape, mb, full_seq, L.tp, L.cp, step_cost.flops_per_second, cp_link, width)
        cp_total = max(cp_total, cp_block)
        costs.append(seconds + tp_seconds + cp_block)
    boundary = mb * seq_len * shape.n_embd * width  # one micro-batch's hidden states at a stage boundary
    sends = p2p_bytes(L.micro_batches, L.pp, L.virtual)  # messages the busiest pipeline rank sends per step
    hop = calibration.link("send", world, pp_span).seconds("send", boundary, 2) if L.pp > 1 else 0.0
    if L.pp == 1:
        compute, bubble = L.micro_batches * costs[0], 0.0
    else:
        unit = max(costs)  # the simulation in units of the busiest stage, cached: many layouts share one
        ratios = (1.0,) if L.virtual > 1 else tuple(round(c / unit, 2) for c in costs)
        step, bubble = _simulated(L.schedule, L.pp, L.micro_batches, L.virtual, ratios, round(hop / unit, 2),
                                  step_cost.forward)
        compute = step * unit
    tp_comm = tp_total * L.micro_batches
    cp_comm = cp_total * L.micro_batches

    # ZeRO's (or plain DP's) collectives over the dp ranks, every micro-batch's included; the optimizer step
    p, dp_span = params[busiest], group_span("dp", sizes)  # the dp · cp replicas: the whole world
    dp_calls = dp_collectives(L, p, max(blocks))
    by_kind = {kind: _collective_seconds({kind: calls}, calibration, world, L.replicas, dp_span)
               for kind, calls in dp_calls.items()}
    dp_comm = sum(by_kind.values())
    if overlap is None:  # published GPU figures stand for engines at scale; this machine's, for the course's
        overlap = bool(calibration.gpus_per_node)
    dp_hidden = 0.0
    if overlap and dp_calls:  # the busiest stage's forward and backward of one micro-batch hide what they can
        pieces = L.grad_collectives if L.zero == 0 and L.grad_collectives > 1 else blocks[busiest] + 1
        exposed = _exposed_dp(L, by_kind, *passes[busiest], pieces)
        dp_comm, dp_hidden = exposed, dp_comm - exposed
    tied = 0.0
    if L.pp > 1 and L.virtual == 1 and shape.tied_head:  # the tied embedding's gradient between first and last stage
        tied = shape.vocab_size * shape.n_embd // L.tp * width
        dp_comm += calibration.link("all_reduce", world, pp_span).seconds("all_reduce", tied, 2)
    cp_sent = 0.0
    if L.cp > 1:  # ring attention's K/V blocks (and dK/dV) per block and micro-batch, the tp rank's key/value heads
        kv_heads = max(1, (shape.kv_heads or shape.n_head) // L.tp)
        cp_sent = max(blocks) * L.micro_batches * cp_wire_bytes("ring", mb, kv_heads, full_seq,
                                                                 shape.n_embd // shape.n_head, L.cp, width).total
    sent = {"dp": wire_bytes(dp_calls, L.replicas), "tp": tp_sent * L.micro_batches, "cp": cp_sent,
            "pp": sends * boundary, "embedding": ring_wire_bytes("all_reduce", tied, 2)}
    total_params = sum(rank_parameters(shape, 1, 1))
    share = p / total_params / (L.replicas if L.zero >= 1 else 1)
    optimizer = step_cost.optimizer * share
    return Priced(L, p, memory.state_bytes, memory.activation_bytes, memory.in_flight, compute, tp_comm, dp_comm,
                  optimizer, bubble, memory.working_bytes, cp_comm, dp_hidden, sends * hop,
                  {k: v for k, v in sent.items() if v})
