"""DP × TP × PP: replicas of a pipeline whose stages are split by heads, on ``dp·tp·pp`` ranks.

Rank ``mesh.rank_at(dp=d, pp=j, tp=t)`` (:class:`~parallel_lib.runtime.mesh.Mesh`) holds slice t
of stage j of replica d (:class:`~parallel_lib.hybrid.tp_stages.TensorParallelStage`). A
training step on it:

[1] take replica d's rows of the global batch (every rank generates the same batches);
[2] run stage j's actions of the schedule (GPipe or 1F1B, chapter 04's ``make_schedule``)
    with the one pipeline runtime (:func:`~parallel_lib.pipeline_parallel.runtime.run_actions`,
    chapter 05's :class:`~parallel_lib.pipeline_parallel.stage.StageRunner`, one
    ``batch_isend_irecv`` per exchange on the pipeline group of slice t); inside each forward and backward the
    tensor-parallel group of the stage all-reduces as chapter 07 does;
[3] sum the tied embedding's gradient between first and last stage of slice t, then
    average the stage's gradients over its data-parallel group: chapter 05's
    :class:`~parallel_lib.hybrid.gradients.StageGradients` (``BucketedAllReduce(group=)``);
[4] take the optimizer step.

Any axis may be 1: the same function runs pure TP or PP, DP×TP, TP×PP and DP×PP. Every
collective of a step is counted (:func:`~parallel_lib.runtime.count_collectives`) and
sorted by the group it ran in, for :mod:`.cost3d`'s formulas; the model state is counted
from the tensors (:func:`~parallel_lib.model_parallel.memory.memory_report`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from parallel_lib.common.checks import check_choice, positive_int
from parallel_lib.common.models import GPT2_SIZES, build_gpt2
from parallel_lib.common.timeline import DeviceClock
from parallel_lib.common.training import TrainRecord
from parallel_lib.data_parallel.ring import require_process_group
from parallel_lib.hybrid.gradients import StageGradients
from parallel_lib.hybrid.tp_stages import TensorParallelStage, dense_state, stage_loss
from parallel_lib.model_parallel.memory import memory_report
from parallel_lib.pipeline_parallel.link import StageLink, leave_together, wait_for
from parallel_lib.pipeline_parallel.runtime import RankStages, run_actions
from parallel_lib.pipeline_parallel.schedule import SCHEDULES, Schedule, make_schedule
from parallel_lib.pipeline_parallel.stage import StageRunner, move_stage
from parallel_lib.pipeline_parallel.transports import ProcessLink
from parallel_lib.runtime.collectives import CollectiveCounter, count_collectives
from parallel_lib.runtime.device import rank_device
from parallel_lib.runtime.mesh import Mesh, RankMesh
from parallel_lib.tensor_parallel.convert import gather_dense, tensor_parallelize
from parallel_lib.tensor_parallel.train import TPConfig, make_batches

__all__ = ["Config3D", "Result3D", "run_3d", "run_3d_many", "batches_3d", "model_overrides"]


@dataclass(frozen=True)
class Config3D:
    """One DP × TP × PP training run; the same on every rank."""

    dp: int = 2
    tp: int = 2
    pp: int = 2
    model: str = "tiny"             # a GPT2_SIZES name
    n_layer: int = 0                # 0: the size's own depth (overrides keep the tests fast)
    n_embd: int = 0                 # 0: the size's own width
    vocab_size: int = 128           # divisible by tp
    seq_len: int = 16
    batch_size: int = 8             # GLOBAL rows per step: each replica gets batch_size / dp
    micro_batches: int = 2          # per replica and step; must divide its rows
    schedule: str = "1f1b"          # "gpipe" or "1f1b"
    recompute: bool = False         # keep only each stage's input, run its forward again in backward
    optimizer: str = "sgd"          # "sgd" (update proportional to the gradient: a wrong scale shows) or "adamw"
    lr: float = 0.5
    steps: int = 2
    seed: int = 0
    timeout: float = 60.0           # seconds any one receive or collective may wait
    order: str = "tp-pp-dp"         # the mesh's axis order, fastest first ("tp-dp-pp": Megatron-LM's)
    return_state: bool = False      # gather the trained parameters (dense names) on slice 0 of each stage

    @property
    def mesh(self) -> Mesh:
        return Mesh(dp=self.dp, tp=self.tp, pp=self.pp, order=self.order)

    def check(self, world_size: Optional[int] = None) -> None:
        """Raise ValueError, naming the field, for a run that cannot work (before any rank starts)."""
        mesh = self.mesh
        if world_size is not None and world_size != mesh.world_size:
            raise ValueError(f"dp * tp * pp must equal world_size={world_size}, got {self.dp} x {self.tp} x "
                             f"{self.pp} = {mesh.world_size}")
        check_choice("model", self.model, sorted(GPT2_SIZES))
        check_choice("schedule", self.schedule, sorted(SCHEDULES))
        check_choice("optimizer", self.optimizer, ["adamw", "sgd"])
        for name in ("batch_size", "micro_batches", "steps", "seq_len", "vocab_size"):
            positive_int(name, getattr(self, name))
        shape = {**GPT2_SIZES[self.model], **model_overrides(self)}
        if self.pp > shape["n_layer"]:
            raise ValueError(f"pp must be <= the model's {shape['n_layer']} blocks, got pp={self.pp}")
        for name, value in (("n_head", shape["n_head"]), ("vocab_size", self.vocab_size)):
            if value % self.tp:
                raise ValueError(f"tp={self.tp} must divide {name}={value}")
        if self.batch_size % (self.dp * self.micro_batches):
            raise ValueError(f"batch_size must split into dp={self.dp} replicas of micro_batches="
                             f"{self.micro_batches} equal micro-batches, got batch_size={self.batch_size}")
        if self.seq_len > shape["n_positions"] or self.timeout <= 0:
            raise ValueError(f"seq_len must be <= n_positions={shape['n_positions']} and timeout > 0, got "
                             f"seq_len={self.seq_len}, timeout={self.timeout}")


def model_overrides(config: Config3D) -> dict[str, int]:
    """``build_gpt2`` overrides of the run's depth and width."""
    return {k: getattr(config, k) for k in ("n_layer", "n_embd") if getattr(config, k)}


def batches_3d(config: Config3D) -> list[dict[str, torch.Tensor]]:
    """The run's global batches: chapter 07's synthetic right-padded rows (the same in every process)."""
    return make_batches(TPConfig(model=config.model, vocab_size=config.vocab_size, batch_size=config.batch_size,
                                 seq_len=config.seq_len, steps=config.steps, seed=config.seed))


@dataclass
class Result3D:
    """What one rank measured.

    ``traffic`` is one step's (the last one's) collectives by group kind ("tp", "pp", "dp",
    "tied"): ``{collective: (calls, message bytes)}``; ``wire`` the bytes this rank sent per kind.
    """

    rank: int
    coords: tuple[int, int, int]    # (replica d, stage j, slice t)
    config: Config3D
    record: TrainRecord             # loss share on the last stage (NaN elsewhere), global tokens, seconds
    traffic: dict[str, dict[str, tuple[int, int]]]
    wire: dict[str, float]
    state_bytes: int                # parameters + gradients + optimizer states, from the tensors
    num_parameters: int
    blocks: list[int]
    state: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def step_times(self) -> list[float]:
        return self.record.step_times


def _by_group(counter: CollectiveCounter, pm: RankMesh
              ) -> tuple[dict[str, dict[str, tuple[int, int]]], dict[str, float]]:
    """Sort one step's calls by the group they ran in: a group is known by its ranks."""
    kinds = {tuple(pm.peers("tp")): "tp", tuple(pm.peers("dp")): "dp"}
    if pm.size("pp") > 1:
        kinds[tuple(pm.peers("tied"))] = "tied"
    traffic: dict[str, dict[str, tuple[int, int]]] = {"tp": {}, "pp": {}, "dp": {}, "tied": {}}
    wire = dict.fromkeys(traffic, 0.0)
    for call in counter.calls:
        kind = "pp" if call.kind in ("send", "recv") else kinds.get(call.ranks, "other")
        calls, nbytes = traffic.setdefault(kind, {}).get(call.kind, (0, 0))
        traffic[kind][call.kind] = (calls + 1, nbytes + call.nbytes)
        wire[kind] = wire.get(kind, 0.0) + call.wire_bytes
    return traffic, wire


def _step(stage: TensorParallelStage, runner: StageRunner, link: StageLink, pipeline: list[int], schedule: Schedule,
          j: int, batch: dict[str, torch.Tensor], denominator: float, recompute: bool) -> float:
    """Stage j's actions for one replica batch [2], with the one pipeline runtime; the loss share on the last stage."""
    m = schedule.num_micro_batches
    ids, labels, weights = (torch.tensor_split(batch[k], m) for k in ("input_ids", "labels", "label_token_weights"))
    dtype = next(stage.parameters()).dtype  # the hidden states every stage sends: the model's dtype
    spec = lambda message: (stage.hidden_shape(*ids[message.micro_batch].shape), dtype)  # noqa: E731  (1/tp under SP)
    loss = (lambda i: stage_loss(stage, labels[i], weights[i], denominator)) if stage.last else None
    stages = RankStages(schedule, j, {j: runner}, ids, loss=loss, recompute=lambda i: recompute)
    run_actions(schedule, j, stages, ProcessLink(schedule, j, link, pipeline, spec))
    return stages.loss_sum()


def _stage_on_device(shard: nn.Module, j: int, pp: int, device: torch.device, keep_shard: bool) -> TensorParallelStage:
    """Stage j of this rank's TP shard, alone on ``device``: the shard is cut on the CPU and only the stage moves.

    The stage refers to the whole shard (for its config, group and mask); the other stages' blocks
    are freed (moved to the meta device) unless ``keep_shard`` (``return_state`` gathers the whole shard).
    """
    stage = move_stage(TensorParallelStage(shard, j, pp), device)
    if not keep_shard:
        mine = {id(p) for p in stage.parameters()}
        for module in shard.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                if id(param) not in mine:
                    setattr(module, name, nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=False))
    return stage


def run_3d(rank: int, world_size: int, config: Config3D = Config3D()) -> Result3D:
    """Train slice t of stage j of replica d, ``config.mesh.rank_at(dp=d, pp=j, tp=t)``; the worker for ``launch``.

    Raises:
        ValueError: a config that does not fit ``world_size`` or the model (named in the message).
        TimeoutError, RuntimeError: a receive or collective waited longer than ``config.timeout``
            or its peer failed; the message names this rank, its coordinates and what it waited for.
    """
    require_process_group("run_3d")
    config.check(world_size)
    with config.mesh.build(config.timeout) as pm:  # every group, made once; destroyed when the run ends
        try:
            return _run_3d(pm, config)
        finally:
            leave_together(pm.group("pp"), config.timeout)


def _run_3d(pm: RankMesh, config: Config3D) -> Result3D:
    d, j, t = coords = pm.index("dp"), pm.index("pp"), pm.index("tp")
    dp, pp = pm.size("dp"), pm.size("pp")
    who = f"rank {pm.rank} (replica {d}, stage {j}, slice {t})"
    device = rank_device()
    dense = build_gpt2(config.model, config.vocab_size, config.seed, **model_overrides(config))
    stage = _stage_on_device(tensor_parallelize(dense, pm.group("tp"), dropout_seed=config.seed), j, pp, device,
                             keep_shard=config.return_state)
    del dense
    stage.train()
    params = list(stage.parameters())
    optimizer = (torch.optim.AdamW if config.optimizer == "adamw" else torch.optim.SGD)(params, lr=config.lr)
    runner = StageRunner(stage, device, first=stage.first)
    pipeline = pm.peers("pp")
    link = StageLink(None, None, who, config.timeout, device, group=pm.group("pp"))
    gradients = StageGradients(stage, stage.tied, pm.group("tied") if pp > 1 else None, pm.group("dp"), dp, who,
                               config.timeout)
    wait_for(dist.barrier(group=pm.group("pp"), async_op=True), config.timeout, f"{who}: start-up barrier")
    schedule = make_schedule(config.schedule, pp, config.micro_batches)
    record, clock = TrainRecord(), DeviceClock([device])
    for step, batch in enumerate(batches_3d(config)):
        denominator = float(batch["label_token_weights"].sum()) / dp  # the dp mean divides by dp again
        mine = {k: v.chunk(dp)[d].to(device) for k, v in batch.items()}  # [1]
        start = clock()
        with count_collectives() as counter:
            optimizer.zero_grad(set_to_none=True)
            loss = _step(stage, runner, link, pipeline, schedule, j, mine, denominator, config.recompute)  # [2]
            gradients.synchronize()  # [3]
            optimizer.step()  # [4]
        record.append(loss / dp if stage.last else float("nan"), int(batch["label_token_weights"].sum()),
                      clock() - start)
    traffic, wire = _by_group(counter, pm)
    state = dense_state(stage, pp, gather_dense(stage.model)) if config.return_state else {}
    return Result3D(pm.rank, coords, config, record, traffic, wire,
                    sum(row.total for row in memory_report(nn.Sequential(stage), optimizer).values()),
                    sum(p.numel() for p in params), list(stage.blocks_index), state if t == 0 else {})


def run_3d_many(rank: int, world_size: int, configs: Sequence[Config3D]) -> list[Result3D]:
    """:func:`run_3d` for each config in turn, in one launch (starting ranks costs seconds)."""
    return [run_3d(rank, world_size, config) for config in configs]

