"""The one training entry: (model builder, mesh, plan, run config) -> a trained shard and its record.

Every rank builds the same dense GPT-2 from the run's seed and then applies the plan, in
this order (torchtitan's ``parallelize_llama`` order; :mod:`.plan` says what each axis means):

[1] tp: split every block by heads over ``pm.group("tp")`` (chapter 07); with ``run.experts``
    the blocks' MLPs become chapter 12's mixtures (:mod:`.experts`), their experts spread over
    ``pm.group("ep")``, and with ``cp`` every block's attention becomes ring attention over
    ``pm.group("cp")`` (chapter 11, :func:`~parallel_lib.context_parallel.parallelize_cp`);
[2] pp: keep stage ``j`` of ``pp`` (chapter 04's balance; the last stage keeps a copy of the
    tied embedding as the head);
[3] dp: hand the stage's parameters to :class:`~parallel_lib.sharding.ZeroEngine` over
    ``pm.group("dp")`` (chapter 06; stage 0 is plain data parallelism: one all-reduce per
    bucket), or over the flattened ``("dp", "cp")`` / ``("dp", "ep")`` group, the experts over
    ``dp`` alone (:mod:`.data_axis`). The tied embedding gets a flat group of its own, so that
    its copies on the first and last stage are summed shard by shard.

A step on rank ``(d, j, t)`` (and ``c``, ``e`` on the cp and ep axes):

[4] take replica ``d·ep + e``'s rows of the global batch (one batch source for every process,
    the reference too) and, under cp, shard ``c`` of every row (``Plan.cp_layout``), with the
    loss divided by the global token count over ``Plan.replicas`` = dp·cp·ep (the mean over
    them then gives the global token mean);
[5] run stage j's actions of the schedule with the one pipeline runtime
    (:func:`~parallel_lib.pipeline_parallel.runtime.run_actions`), exchanging with slice t of the
    neighbouring stages over ``pm.group("pp")``, one ``batch_isend_irecv`` per exchange; each
    micro-batch's forward is numbered for the model's seeded dropout masks (drawn per replica) as
    ``reference(run, dp=dp, micro_batches=m)`` numbers its forwards, so with dropout too every
    layout drops what one process drops (chapter 07's proof);
[6] reduce the gradients over dp (ZeRO's reduce-scatter or all-reduce), sum the
    sequence-parallel norms' gradients over tp and the tied copies over the pipeline's ends
    (:func:`~parallel_lib.training.stage_gradients.reduce_stage_gradients`);
[7] AdamW on this rank's shard; ZeRO-1/2 all-gather the updated parameters.

Every collective of a step is counted and sorted by the mesh axis it ran on, and each step is
split into its phases (data, compute, sync, optimizer, gc: :mod:`.phases`) in ``TrainRecord.phases``.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from transformers import GPT2LMHeadModel

from parallel_lib.common.checks import check_choice, check_int, check_number, positive_int
from parallel_lib.common.models import GPT2_SIZES, build_gpt2
from parallel_lib.common.timeline import Event, TimelineRecorder
from parallel_lib.common.training import TrainRecord
from parallel_lib.context_parallel.layout import shard_sequence
from parallel_lib.context_parallel.parallelize import parallelize_cp
from parallel_lib.expert_parallel.parallelize import parallelize_ep
from parallel_lib.data_parallel.ring import require_process_group
from parallel_lib.pipeline_parallel.link import StageLink, leave_together, wait_for
from parallel_lib.pipeline_parallel.schedule import make_schedule
from parallel_lib.pipeline_parallel.stage import StageRunner
from parallel_lib.runtime.collectives import CollectiveCounter, count_collectives
from parallel_lib.runtime.device import rank_device
from parallel_lib.runtime.mesh import RankMesh
from parallel_lib.sharding.checkpoint import shard_state
from parallel_lib.tensor_parallel.convert import gather_dense, tensor_parallelize
from parallel_lib.training.batches import DATA_SOURCES, global_batches, replica_rows
from parallel_lib.training.averagers import OPTIMIZERS, check_optimizer
from parallel_lib.training.checkpoints import Checkpoint, load_checkpoint
from parallel_lib.training.data_axis import data_parallel_axis, mesh_flatten
from parallel_lib.training.experts import dense_mlps, holds_mixtures, mixture_of_experts, mixture_state, swap_mixtures
from parallel_lib.training.phases import StepPhases
from parallel_lib.training.plan import Plan
from parallel_lib.training.stage_gradients import reduce_stage_gradients
from parallel_lib.training.step import pipeline_step, stage_on_device
from parallel_lib.training.tp_stage import dense_state
from parallel_lib.training.zero_options import (axis_census, check_zero_options, freeze_parameters, measured_step,
                                                trace_collectives, zero_padding)

__all__ = ["RunConfig", "TrainResult", "train", "train_many", "build_model", "check_layout"]


@dataclass(frozen=True)
class RunConfig:
    """What is trained, on what, for how long; the same on every rank and in the reference."""

    model: str = "tiny"             # a GPT2_SIZES name
    n_layer: int = 0                # 0: the size's own depth
    n_embd: int = 0                 # 0: the size's own width
    vocab_size: int = 128           # divisible by tp
    seq_len: int = 16
    batch_size: int = 8             # GLOBAL rows per step
    steps: int = 2
    lr: float = 1e-3                # AdamW
    eps: float = 1e-8               # AdamW's; a large one makes the update depend on the gradient's scale
    weight_decay: float = 0.01
    seed: int = 0                   # weights, batches and dropout masks
    dropout: float = 0.0            # resid, attn and embd dropout (seeded masks: parallel_lib.models.dropout)
    padding: bool = True            # synthetic data: right-pad some rows (their padded tokens carry no loss weight)
    data: str = "synthetic"         # the batch source: "synthetic" or "corpus" (parallel_lib.training.batches)
    train_examples: int = 2048      # corpus: the first pairs of the train split
    data_seed: int = 1234           # corpus: the shuffle (a new one per epoch)
    timeout: float = 60.0           # seconds any receive or collective may wait
    return_state: bool = True       # send the trained parameters back (dense names)
    timeline_steps: int = 0         # record the first steps' compute and communication events (TrainResult.events)
    precision: str = "fp32"         # ZeRO: "bf16" parameters and gradients with an fp32 master (chapter 06)
    collectives: str = "torch"      # ZeRO's reduce-scatter and all-gather: "torch" or the course's "ring"
    prefetch: bool = False          # ZeRO-3: all-gather the next layer group while this one computes
    bucket_cap_mb: float = 25.0     # gradient bucket size (MB)
    freeze: tuple[str, ...] = ()    # dense parameter names that do not train (here and in the reference)
    max_grad_norm: float = 0.0      # clip the mean gradient to this global L2 norm before each step (0: off)
    measure_step: int = -1          # the step whose census and collectives TrainResult reports (-1: the last)
    return_shards: bool = False     # ZeRO: send this rank's checkpoint shard back (sharding.shard_state)
    optimizer: str = "adamw"        # chapter 01's averagers (Plan.sync) may step "sgd" instead (lr only)
    overlap: bool = True            # sync "bucketed": all-reduce each bucket from backward's gradient hooks
    experts: int = 0                # > 0: every MLP a mixture of this many experts (chapter 12, .experts); 0: dense
    top_k: int = 1                  # experts: the experts each token is routed to
    capacity_factor: float = 0.0    # experts: slots per expert over the fair share (0: no limit, nothing dropped)

    def overrides(self) -> dict[str, int]:
        """``build_gpt2`` overrides of depth and width."""
        return {k: getattr(self, k) for k in ("n_layer", "n_embd") if getattr(self, k)}

    @property
    def shape(self) -> dict[str, int]:
        """The model's n_layer, n_embd, n_head and n_positions."""
        check_choice("model", self.model, sorted(GPT2_SIZES))
        return {**GPT2_SIZES[self.model], **self.overrides()}

    def check(self) -> None:
        """Raise ValueError, naming the field, for a run that cannot work.

        Raises:
            ValueError: an unknown model, a size below 1, a sequence longer than the model's
                positions, a non-positive learning rate, eps or timeout, dropout outside [0, 1), or
                a mixture (``experts`` > 0) with ``top_k`` outside [1, experts], a negative
                ``capacity_factor`` or dropout.
        """
        for name in ("vocab_size", "seq_len", "batch_size", "steps", "train_examples"):
            positive_int(name, getattr(self, name))
        check_int("timeline_steps", self.timeline_steps, 0)
        check_choice("data", self.data, DATA_SOURCES)
        if self.data == "corpus" and self.vocab_size < 258:
            raise ValueError(f"the corpus tokenizer needs vocab_size >= 258 (256 bytes and 2 special tokens), "
                             f"got vocab_size={self.vocab_size}")
        check_number("dropout", self.dropout, 0.0)
        if self.dropout >= 1.0:
            raise ValueError(f"dropout must be below 1 (1 drops everything), got dropout={self.dropout}")
        for name in ("lr", "eps", "timeout"):
            check_number(name, getattr(self, name), 0.0, strict=True)
        if self.seq_len > self.shape["n_positions"]:
            raise ValueError(f"seq_len must be <= n_positions={self.shape['n_positions']}, got seq_len={self.seq_len}")
        check_zero_options(self)
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_int("experts", self.experts, 0, hint="0 for the dense MLP")
        if self.experts:
            check_int("top_k", self.top_k, 1, self.experts, hint=f"a token chooses 1 to experts={self.experts}")
            check_number("capacity_factor", self.capacity_factor, 0.0, hint="0 for no limit")
            if self.dropout:
                raise ValueError(f"experts={self.experts} with dropout={self.dropout} is not supported yet: the "
                                 "mixtures' dropout is not proved; set dropout=0.0")


def check_layout(plan: Plan, run: RunConfig, world_size: Optional[int] = None) -> None:
    """Refuse, before any rank starts, a run or a plan that cannot work on ``world_size`` ranks and the run's model.

    Raises:
        ValueError: what :meth:`RunConfig.check` and :meth:`Plan.check` refuse (named in the message);
            cp > 1 with dropout or a ``seq_len`` not divisible by 2·cp; ep > 1 without experts or
            with ``experts`` not divisible by ep, or with ``freeze``; experts with tp or pp > 1.
    """
    run.check()
    shape = run.shape
    plan.check(world_size, shape["n_layer"], shape["n_head"], run.vocab_size, run.batch_size)
    check_zero_options(run, plan)
    check_optimizer(plan, run)
    if plan.cp > 1:
        if run.dropout:
            raise ValueError(f"cp={plan.cp} needs dropout=0.0 (ring attention's shards are not one slice of the "
                             f"masks), got dropout={run.dropout}")
        if run.seq_len % (2 * plan.cp):
            raise ValueError(f"cp={plan.cp} cuts every sequence into 2·cp = {2 * plan.cp} chunks: seq_len must be "
                             f"divisible by {2 * plan.cp}, got seq_len={run.seq_len}")
    if plan.ep > 1:
        if not run.experts:
            raise ValueError(f"ep={plan.ep} spreads the experts of a mixture: set experts (e.g. experts={2 * plan.ep})"
                             ", got experts=0")
        if run.experts % plan.ep:
            raise ValueError(f"ep={plan.ep} must divide experts={run.experts} (each rank holds experts/ep of them)")
        if run.freeze:
            raise ValueError(f"freeze with ep={plan.ep} is not supported yet; set freeze=()")
    if run.experts and (plan.tp > 1 or plan.pp > 1):
        raise ValueError(f"experts={run.experts} with tp={plan.tp}, pp={plan.pp} is not supported yet: the "
                         "mixtures train with dp and ep only; use tp=1 and pp=1")


def build_model(run: RunConfig) -> GPT2LMHeadModel:
    """The dense model every rank and the reference start from (the run's seed)."""
    model = build_gpt2(run.model, run.vocab_size, run.seed, resid_pdrop=run.dropout, attn_pdrop=run.dropout,
                       embd_pdrop=run.dropout, **run.overrides())
    model.loss_type = "ForCausalLM"  # the loss of ``labels=`` (chapter 06's census); unset, transformers warns
    return model


@dataclass
class TrainResult:
    """What one rank measured and trained.

    ``traffic`` is the measured step's (``run.measure_step``, by default the last) collectives by
    mesh axis ("dp", "tp", "pp", "tied", and "cp", "ep" where used; "local": calls on a group of one
    rank; "dp" holds the flattened group of a cp or ep plan's gradient average):
    ``{collective: (calls, message bytes)}``; ``wire`` the bytes this rank sent per axis.
    ``state`` holds the parameters this rank's stage trained, by the dense model's names
    (tensor slice 0 of each stage only; empty unless ``run.return_state``).
    ``activation_bytes``: the most bytes autograd held saved for backward at once in the first
    step (one forward's with one micro-batch; chapter 07 compares it with and without sequence
    parallelism); ``parameter_bytes``: the bytes of this rank's stage before any ZeRO sharding.
    """

    rank: int
    coords: dict[str, int]
    plan: Plan
    record: TrainRecord             # loss share on the last stage (NaN elsewhere), global tokens, seconds, phases
    traffic: dict[str, dict[str, tuple[int, int]]]
    wire: dict[str, float]
    state_bytes: int                # parameters + gradients + optimizer states this rank holds (tensor census)
    num_parameters: int             # elements this rank owns after sharding
    activation_bytes: int = 0
    parameter_bytes: int = 0
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)  # the first run.timeline_steps steps (lane: this rank)
    census: dict[str, int] = field(default_factory=dict)  # the measured step's params, grads, optimizer, total bytes
    trainable_parameters: int = 0   # Ψ: trainable elements of this rank's stage before sharding (the formulas')
    padding: int = 0                # ZeRO: elements added to round every flat group up to a multiple of dp
    shards: Optional[dict] = None   # run.return_shards: sharding.shard_state after the last step
    peak_micro_batches: int = 0     # the most micro-batches whose activations this rank held at once

    @property
    def collectives(self) -> dict[str, tuple[int, int]]:
        """The measured step's collectives over every axis together: ``{collective: (calls, message bytes)}``.

        Calls on a group of one rank (``traffic["local"]``), which send nothing, are left out.
        """
        total: dict[str, tuple[int, int]] = {}
        for axis, calls in self.traffic.items():
            if axis == "local":
                continue
            for kind, (n, nbytes) in calls.items():
                before = total.get(kind, (0, 0))
                total[kind] = (before[0] + n, before[1] + nbytes)
        return total

    @property
    def wire_bytes(self) -> float:
        """The bytes this rank sent in the measured step, every axis together."""
        return sum(self.wire.values())


ModelBuilder = Callable[[RunConfig], GPT2LMHeadModel]  # the dense model from the run


def train(rank: int, world_size: int, plan: Plan, run: RunConfig = RunConfig(),
          builder: ModelBuilder = build_model, resume: Optional[Checkpoint] = None) -> TrainResult:
    """Train the plan's shard on this rank; the worker function for ``launch``.

    Args:
        rank, world_size: as ``launch`` passes them; ``world_size`` must be the plan's mesh's.
        plan: which parallelism on which axis.
        run: the model, batches and optimizer (the same on every rank).
        builder: builds the dense model from ``run`` (every rank, the same weights).
        resume: a plain checkpoint ``(model state, AdamW state, first step)`` by the dense model's
            names (:mod:`.checkpoints`) to continue from: steps before ``first step`` are skipped.

    Raises:
        ValueError: a plan or run that cannot work (named in the message).
        TimeoutError, RuntimeError: a receive or collective waited longer than ``run.timeout``
            or its peer failed; the message names this rank, its coordinates and what it waited for.
    """
    require_process_group("train")
    check_layout(plan, run, world_size)
    if resume is not None and (plan.cp > 1 or plan.ep > 1):
        raise ValueError(f"resume with cp={plan.cp} or ep={plan.ep} is not supported yet; train without resume")
    with plan.mesh.build(run.timeout, flatten=mesh_flatten(plan)) as pm:  # every group, made once, destroyed at the end
        try:
            return _train(pm, plan, run, builder, resume)
        finally:  # a peer still waiting for a message times out naming it, instead of seeing the group vanish
            leave_together(pm.group("pp"), run.timeout)


def train_many(rank: int, world_size: int, jobs: Sequence[tuple[Plan, RunConfig]]) -> list[TrainResult]:
    """:func:`train` for each (plan, run) in turn, in one launch (starting ranks is the slow part)."""
    return [train(rank, world_size, plan, run) for plan, run in jobs]


def _train(pm: RankMesh, plan: Plan, run: RunConfig, builder: ModelBuilder,
           resume: Optional[Checkpoint]) -> TrainResult:
    d, j, t, c, e = (pm.index(axis) for axis in ("dp", "pp", "tp", "cp", "ep"))
    pp, rows, replicas = pm.size("pp"), plan.row_replicas, plan.replicas
    r = d * plan.ep + e  # which rows of every global batch this rank trains on
    who = f"rank {pm.rank} (replica {d}, stage {j}, slice {t}" + (f", cp {c}" if plan.cp > 1 else "") + \
        (f", ep {e}" if plan.ep > 1 else "") + ")"
    device = rank_device()
    sharded = tensor_parallelize(builder(run), pm.group("tp"), plan.sequence_parallel, dropout_seed=run.seed,  # [1]
                                 dropout_replica=r)  # each replica its own dropout masks
    if run.experts:  # the one-process model's mixtures, the same on every rank; then their experts over ep
        swap_mixtures(sharded, mixture_of_experts(builder(run), run))
        if plan.ep > 1:
            parallelize_ep(sharded, pm, run.timeout)
    if plan.cp > 1:
        parallelize_cp(sharded, pm, layout=plan.cp_layout, timeout=run.timeout)
    freeze_parameters(sharded, run.freeze)
    stage = stage_on_device(sharded, j, pp, device, keep_shard=run.return_state)  # [2] only the stage moves
    stage.train()
    parameter_bytes = sum(p.numel() * p.element_size() for p in stage.parameters())
    trainable = sum(p.numel() for p in stage.parameters() if p.requires_grad)
    module, engine = data_parallel_axis(plan, run, stage, pm)  # [3] plan.sync: ZeRO over dp by default
    first = load_checkpoint(engine, resume, run)
    runner = StageRunner(module, device, first=stage.first)
    pipeline = pm.peers("pp")
    link = StageLink(None, None, who, run.timeout, device, group=pm.group("pp"))
    wait_for(dist.barrier(group=pm.group("pp"), async_op=True), run.timeout, f"{who}: start-up barrier")
    schedule = make_schedule(plan.schedule, pp, plan.micro_batches)
    record = TrainRecord()
    recorder, lane = TimelineRecorder(device=device), f"rank {pm.rank}"  # a GPU: CUDA events, read after the steps
    counter, activations, peak, census, measured = CollectiveCounter(), 0, 0, {}, measured_step(run)
    with StepPhases(recorder) as phases:  # data, compute, sync, optimizer, gc: TrainRecord.phases
        for k, batch in enumerate(global_batches(run, rows)):
            if k < first:  # resumed: these steps are in the checkpoint
                continue
            traced = k < run.timeline_steps
            if traced and k == 0:  # every rank's clock starts at (nearly) the same moment
                wait_for(dist.barrier(async_op=True), run.timeout, f"{who}: barrier before the timeline")
                recorder.reset()
            trace_collectives(engine, recorder if traced else None, plan)  # dp alone: ZeRO's collectives too
            if hasattr(engine, "trace"):  # chapter 01's buckets on the timeline (lane "rank R comm")
                engine.trace(recorder if traced else None)
            timed = (lambda kind, i: recorder.record(lane, kind, k * plan.micro_batches + i)) if traced else None
            phases.start()
            tokens = float(batch["label_token_weights"].sum())
            mine = {k: _cp_shard(v, plan, c).to(device) for k, v in replica_rows(batch, r, rows).items()}  # [4]
            phases.mark()
            # the counter's dispatch mode sees every operator (a few ms a step on a CPU): only the reported step pays
            with count_collectives() if k == measured else nullcontext(counter) as step_counter:
                loss, saved, in_flight = pipeline_step(stage, runner, link, pipeline, schedule, j, mine,  # [5]
                                                       tokens / replicas, plan.recompute,
                                                       forwards_before=k * plan.micro_batches, record=timed)
                activations, peak = activations if k else saved, max(peak, in_flight)
                phases.mark()
                comm = (lambda label: recorder.record(lane, "comm", None, label)) if traced else None
                reduce_stage_gradients(engine, stage, pm, who, run.timeout, comm)  # [6]
                phases.mark()
                if k == measured:  # between backward and step: the most this rank holds
                    census, counter = axis_census(engine), step_counter
                if run.max_grad_norm:  # by the global norm of the mean gradient
                    engine.clip_grad_norm_(run.max_grad_norm)
                engine.step()  # [7]
                phases.mark()
            seconds, split = phases.read()
            record.append(loss / replicas if stage.last else float("nan"), int(tokens), seconds, split)
    traffic, wire = _by_axis(counter, pm, plan)
    held = census["total"]
    owned = sum(t.numel() for t in engine.master)
    shards = shard_state(engine) if run.return_shards else None
    engine.remove()  # ZeRO-3: the full parameters back in the model
    state = _dense_state(stage, pp) if run.return_state else {}
    return TrainResult(pm.rank, pm.coords, plan, record, traffic, wire, held, owned, activations, parameter_bytes,
                       state if t == 0 else {}, list(recorder.events), census, trainable, zero_padding(engine), shards,
                       peak_micro_batches=peak)


def _cp_shard(rows: torch.Tensor, plan: Plan, c: int) -> torch.Tensor:
    """Context-parallel rank ``c``'s tokens of every row (the whole rows when cp = 1)."""
    return shard_sequence(rows, plan.cp, c, plan.cp_layout, dim=1) if plan.cp > 1 else rows


def _dense_state(stage: Any, pp: int) -> dict[str, torch.Tensor]:
    """The stage's trained parameters by the dense (or one-process mixture) model's names."""
    with dense_mlps(stage.model):  # gather_dense reads the dense MLPs' layout; a mixture's state is its own
        state = dense_state(stage, pp, gather_dense(stage.model))
    if not holds_mixtures(stage.model):
        return state
    return {**{k: v for k, v in state.items() if ".mlp." not in k}, **mixture_state(stage.model)}


def _by_axis(counter: CollectiveCounter, pm: RankMesh, plan: Plan) -> tuple[dict[str, dict[str, tuple[int, int]]],
                                                                dict[str, float]]:
    """Sort one step's calls by the mesh axis they ran on: a group is known by its ranks.

    The flattened ``("dp", "cp")`` / ``("dp", "ep")`` group averages gradients: "dp". Point-to-point
    messages are the pipeline's ("pp"), or the ring attention's ("cp": cp runs without pp); every
    all-to-all is the experts' dispatch and combine ("ep").
    """
    axes = {tuple(pm.peers(a)): a for a in ("dp", "tp", "ep", "cp") if pm.size(a) > 1}
    for flat in mesh_flatten(plan):  # after the single axes: with dp = 1 it holds the same ranks as cp or ep
        axes[tuple(pm.peers(flat))] = "dp"
    if pm.size("pp") > 1 and pm.index("pp") in (0, pm.size("pp") - 1):  # inner stages hold no tied copy
        axes[tuple(pm.peers("tied"))] = "tied"
    used = ("dp", "tp", "pp", "tied") + tuple(a for a in ("cp", "ep") if pm.size(a) > 1)  # as before without them
    traffic: dict[str, dict[str, tuple[int, int]]] = {a: {} for a in used}
    wire = dict.fromkeys(traffic, 0.0)
    point_to_point = "cp" if pm.size("cp") > 1 else "pp"
    for call in counter.calls:
        # a group of one rank (an axis of size 1: ZeRO's engine still reduces over it) sends nothing
        axis = point_to_point if call.kind in ("send", "recv") else "local" if call.group_size == 1 else \
            "ep" if call.kind == "all_to_all" else axes.get(call.ranks, "other")
        calls, nbytes = traffic.setdefault(axis, {}).get(call.kind, (0, 0))
        traffic[axis][call.kind] = (calls + 1, nbytes + call.nbytes)
        wire[axis] = wire.get(axis, 0.0) + call.wire_bytes
    return traffic, wire
