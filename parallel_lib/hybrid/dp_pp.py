"""Data parallelism over pipelines: ranks as a (dp, pp) grid, stages talking by send/recv.

Data parallelism (chapter 01) multiplies throughput but every rank holds the whole
model; a pipeline (chapter 04) splits the model but one batch keeps only p devices
busy, minus the bubble. Combined, ``dp`` replicas of a ``pp``-stage pipeline use
``dp * pp`` ranks. The layout is a tensor, and every group is a slice of it::

    mesh = Mesh(dp=dp, pp=pp)      # mesh.ranks[d, j]: stage j of replica d (arange(world) reshaped)

    dp=2, pp=2      stage 0   stage 1
      replica 0        0         1      <- mesh.peers("pp", 0): one pipeline, activations via send/recv
      replica 1        2         3      <- mesh.peers("pp", 2)
                       ^         ^
         mesh.peers("dp", 0) = [0, 2]   mesh.peers("dp", 1) = [1, 3]: the same stage in every replica,
              whose process group averages that stage's gradients (and nothing else)

Each rank runs ``schedule.stages[j]``, the very action list that the threaded
:class:`~parallel_lib.pipeline_parallel.Pipe`, the simulator and the animation of chapter 04
use; only the hand-overs are messages instead of Python objects::

    stage j-1 (rank a)                       stage j (rank b)
    F(i): y = f(x); send(y, to b)   ------>  x = recv(from a); z = g(x)        [2]
    B(i): g = recv(from b);         <------  backward(z, grad_z); send(x.grad, to a)
          backward(y, g)

Each rank runs its actions with the loop a stage thread of ``Pipe`` runs
(:func:`~parallel_lib.pipeline_parallel.runtime.run_actions`), with the same
:class:`~parallel_lib.pipeline_parallel.stage.StageRunner`. Between two actions it sends
what the last one produced and receives what the next one needs in ONE
``dist.batch_isend_irecv`` on the replica's pipeline group ``pm.group("pp")``
(:class:`~parallel_lib.pipeline_parallel.transports.ProcessLink`): with
NCCL a large send waits for its receive, and unpaired sends of two neighbours would wait
for each other forever (:func:`~parallel_lib.pipeline_parallel.link.find_deadlock` shows
it). No tags: messages between two ranks match in order. Every wait has a timeout and
names what it waited for. A training step on rank ``mesh.rank_at(dp=d, pp=j)``:

[1] load replica d's share of the global batch (``partition_dataset``, chapter 01)
    and all-reduce its target-token count over the stage's dp group;
[2] run the stage's actions in schedule order;
[3] sum the gradients of GPT-2's tied embedding between the replica's first and last
    stage (the head's copy lives there, see :mod:`parallel_lib.pipeline_parallel.gpt2`);
[4] average the stage's gradients over its dp group (chapter 01's ``BucketedAllReduce``);
[5] take the optimizer step.

One process training on the same global batches gets the same parameters:
:func:`~parallel_lib.hybrid.results.compare_with_reference` checks it against
the one single-process reference, :func:`parallel_lib.training.reference` on the same corpus
batches (``RunConfig(data="corpus", ...)``). The layout and its groups are the :class:`~parallel_lib.runtime.mesh.Mesh`,
steps [3] and [4] in :mod:`parallel_lib.hybrid.gradients`, results in :mod:`parallel_lib.hybrid.results`.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from parallel_lib.common.models import GPT2_SIZES, build_gpt2
from parallel_lib.common.timeline import DeviceClock, TimelineRecorder
from parallel_lib.common.training import TrainRecord, weighted_cross_entropy
from parallel_lib.data.corpus import load_corpus
from parallel_lib.data.partition import partition_dataset
from parallel_lib.data.tokenizer import collate_batch, get_tokenizer
from parallel_lib.data_parallel.ring import require_process_group
from parallel_lib.hybrid.gradients import StageGradients
from parallel_lib.hybrid.results import HEAD_COPY, HybridResult
from parallel_lib.model_parallel.memory import memory_report
from parallel_lib.pipeline_parallel.gpt2 import gpt2_stages
from parallel_lib.pipeline_parallel.link import StageLink, leave_together, wait_for
from parallel_lib.pipeline_parallel.runtime import RankStages, run_actions
from parallel_lib.pipeline_parallel.schedule import SCHEDULES, Action, Schedule, make_schedule
from parallel_lib.pipeline_parallel.stage import StageRunner, move_stage
from parallel_lib.pipeline_parallel.transports import ProcessLink
from parallel_lib.runtime.device import rank_device
from parallel_lib.runtime.mesh import Mesh, RankMesh

__all__ = ["HybridConfig", "run_hybrid", "run_hybrid_many"]


@dataclass(frozen=True)
class HybridConfig:
    """One run of ``dp`` replicas of a ``pp``-stage GPT-2 pipeline; the same on every rank."""

    dp: int = 2
    pp: int = 2
    schedule: str = "1f1b"              # "gpipe" or "1f1b"
    micro_batches: int = 2              # per replica and step
    model: str = "tiny"                 # a models.GPT2_SIZES name
    batch_size: int = 16                # the GLOBAL batch in sequences; each replica gets batch_size // dp
    steps: int = 3
    train_examples: int = 512           # first pairs of the train split
    vocab_size: int = 2048
    max_length: int = 32                # positions per row
    pad_to_max_length: bool = True      # the same shapes every step: steady timings, exact byte counts
    optimizer: str = "adamw"            # "adamw" or "sgd"
    lr: float = 1e-3
    seed: int = 0                       # weight init, the same on every rank
    data_seed: int = 1234               # shuffle of partition_dataset
    timeout: float = 60.0               # seconds any one receive or collective may wait
    timeline_step: Optional[int] = None  # record this step's forward/backward/comm events
    return_state: bool = False          # send the stage's final parameters back

    def one_process_fields(self) -> dict[str, Any]:
        """The ``RunConfig`` fields whose one-process run, ``parallel_lib.training.reference(RunConfig(**fields),
        dp=self.dp)``, trains on this run's global batches (the corpus, rows padded to ``max_length``).

        Raises:
            ValueError: rows not padded to ``max_length`` (the corpus source pads every row).
        """
        if not self.pad_to_max_length:
            raise ValueError("the one-process run pads every row to its seq_len: use pad_to_max_length=True")
        return dict(data="corpus", model=self.model, vocab_size=self.vocab_size, seq_len=self.max_length,
                    batch_size=self.batch_size, steps=self.steps, train_examples=self.train_examples,
                    data_seed=self.data_seed, seed=self.seed, optimizer=self.optimizer, lr=self.lr)

    @property
    def mesh(self) -> Mesh:
        """The layout: ``dp`` replicas (slowest axis) of ``pp`` stages."""
        return Mesh(dp=self.dp, pp=self.pp)

    def check(self, world_size: Optional[int] = None) -> None:
        """Raise ValueError, naming the field, for a run that cannot work (before starting ranks)."""
        mesh = self.mesh
        if world_size is not None and world_size != mesh.world_size:
            raise ValueError(f"dp * pp must equal world_size={world_size}, got dp={self.dp} x pp={self.pp} = "
                             f"{mesh.world_size}")
        if self.model not in GPT2_SIZES:
            raise ValueError(f"model must be one of {sorted(GPT2_SIZES)}, got model={self.model!r}")
        layers = GPT2_SIZES[self.model]["n_layer"]
        if self.pp > layers:
            raise ValueError(f"pp must be <= the model's {layers} blocks (one per stage at least), got pp={self.pp}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got schedule={self.schedule!r}")
        for name in ("micro_batches", "batch_size", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {name}={getattr(self, name)!r}")
        if self.batch_size % self.dp or self.batch_size // self.dp < self.micro_batches:
            raise ValueError(f"batch_size must split into dp={self.dp} replica batches of at least "
                             f"micro_batches={self.micro_batches} rows, got batch_size={self.batch_size}")
        if self.steps * self.batch_size > self.train_examples:
            raise ValueError(f"steps={self.steps} global batches of {self.batch_size} need train_examples >= "
                             f"{self.steps * self.batch_size}, got train_examples={self.train_examples}")
        if self.optimizer not in ("adamw", "sgd") or self.timeout <= 0:
            raise ValueError(f"optimizer must be 'adamw' or 'sgd' and timeout > 0 seconds, got "
                             f"optimizer={self.optimizer!r}, timeout={self.timeout!r}")


class _Stage:
    """One rank's stage: runs its actions each step with the one pipeline runtime, over its pipeline group [2]."""

    def __init__(self, module: nn.Module, pm: RankMesh, hidden: int, config: HybridConfig,
                 recorder: TimelineRecorder, device: torch.device) -> None:
        self.config, self.recorder, self.hidden = config, recorder, hidden
        self.rank, self.d, self.j = pm.rank, pm.index("dp"), pm.index("pp")
        self.row = pm.peers("pp")
        self.first, self.last = self.j == 0, self.j == pm.size("pp") - 1
        self.lane = f"rank {pm.rank}: replica {self.d}, stage {self.j}"
        self.who = f"rank {pm.rank} (replica {self.d}, stage {self.j})"
        self.runner = StageRunner(module, device, first=self.first)
        self.dtype = next(module.parameters()).dtype  # every stage's hidden states: the model's dtype
        self.link = StageLink(None, None, self.who, config.timeout, device, group=pm.group("pp"))
        self.traced = False  # record events during this step

    def record(self, kind: str, micro_batch: Optional[int], label: str = "") -> Any:
        return self.recorder.record(self.lane, kind, micro_batch, label) if self.traced else nullcontext()

    def _timed(self, action: Action, compute: Callable[[], Any]) -> Any:
        with self.record(action.event_kind, action.micro_batch):
            return compute()

    def step(self, schedule: Schedule, ids: Tensor, labels: Tensor, weights: Tensor, denominator: Tensor
             ) -> tuple[float, int]:
        """Forward and backward of one replica batch; returns (loss share on the last stage, peak held)."""
        m = schedule.num_micro_batches
        ids_mb, labels_mb, weights_mb = (torch.tensor_split(t, m) for t in (ids, labels, weights))
        lm_loss = lambda i: partial(weighted_cross_entropy, labels=labels_mb[i], weights=weights_mb[i],  # noqa: E731
                                    denominator=denominator)
        # (rows, T, C) in the model's dtype, as the sending stage makes it
        spec = lambda message: ((*ids_mb[message.micro_batch].shape, self.hidden), self.dtype)  # noqa: E731
        stages = RankStages(schedule, self.j, {self.j: self.runner}, ids_mb, loss=lm_loss, timed=self._timed)
        self.link.bytes_sent = 0
        run_actions(schedule, self.j, stages, ProcessLink(schedule, self.j, self.link, self.row, spec))
        return stages.loss_sum(), stages.peak


def _stage_of_replica(config: HybridConfig, j: int, device: torch.device
                      ) -> tuple[nn.Module, list[nn.Parameter], dict[int, str], int, Any]:
    """Stage j of the replica, alone on ``device`` (the replica is built on the CPU and cut first), with what
    training it needs.

    Returns:
        The stage module, its copies of the tied embedding, parameter names by id (by the
        unsplit model's names), the hidden width and the collate function and pairs.
    """
    pairs = load_corpus("train", size=config.train_examples)
    tokenizer = get_tokenizer(pairs, vocab_size=config.vocab_size)
    model = build_gpt2(config.model, vocab_size=len(tokenizer), seed=config.seed)
    collate = partial(collate_batch, src_key="de", tgt_key="en", tokenizer=tokenizer,
                      model_max_length=config.max_length, pad_to_max_length=config.pad_to_max_length)
    unsplit = {id(p): name for name, p in model.named_parameters()}
    stages = gpt2_stages(model, ["cpu"] * config.pp)
    tied_ids = {id(p) for pair in stages.tied_parameters for p in pair}
    module = move_stage(stages[j], device)  # only this stage's layers reach the device; the others are dropped here
    names = {id(p): unsplit.get(id(p), HEAD_COPY) for p in module.parameters()}
    tied = [p for p in module.parameters() if id(p) in tied_ids]
    return module, tied, names, model.config.n_embd, (pairs, partial(collate, device=device))


def run_hybrid(rank: int, world_size: int, config: HybridConfig = HybridConfig()) -> HybridResult:
    """Train stage j of replica d, for ``config.mesh.rank_at(dp=d, pp=j) == rank``; the worker for ``launch``.

    Args:
        rank: this rank, in ``[0, world_size)``.
        world_size: ranks in the (initialised) default group; must equal ``config.dp * config.pp``.
        config: the run; the same on every rank.

    Returns:
        This rank's :class:`HybridResult`.

    Raises:
        ValueError: a config that does not fit ``world_size`` or the model (named in the message).
        TimeoutError: a receive, send or all-reduce did not finish within ``config.timeout``;
            the message names this rank, its stage and what it waited for from whom.
        RuntimeError: no initialised process group, or a peer failed while this rank waited on it.
    """
    require_process_group("run_hybrid")
    config.check(world_size)
    with config.mesh.build(config.timeout) as pm:  # every group, made once; destroyed when the run ends
        try:
            return _run_hybrid(pm, config)
        finally:
            leave_together(pm.group("pp"), config.timeout)


def _run_hybrid(pm: RankMesh, config: HybridConfig) -> HybridResult:
    d, j, dp = pm.index("dp"), pm.index("pp"), pm.size("dp")
    device = rank_device()
    module, tied, names, hidden, (pairs, collate) = _stage_of_replica(config, j, device)
    params = list(module.parameters())
    optimizer = (torch.optim.AdamW if config.optimizer == "adamw" else torch.optim.SGD)(params, lr=config.lr)
    clock = DeviceClock([device])  # this rank's device only
    recorder = TimelineRecorder(device=device)  # a GPU: CUDA events, read with recorder.events
    stage = _Stage(module, pm, hidden, config, recorder, device)
    gradients = StageGradients(module, tied, pm.group("tied") if len(tied) == 1 else None, pm.group("dp"), dp,
                               stage.who, config.timeout, stage.record)
    # NCCL: the first p2p call in a group must involve every rank of it; a barrier sets the
    # communicator up first (cheap on gloo)
    wait_for(dist.barrier(group=pm.group("pp"), async_op=True), config.timeout, f"{stage.who}: start-up barrier")
    schedule = make_schedule(config.schedule, config.pp, config.micro_batches)
    batches = iter(partition_dataset(d, dp, pairs, batch_size=config.batch_size, collate_fn=collate,
                                     seed=config.data_seed))
    record, peak = TrainRecord(), 0
    for step in range(config.steps):
        batch = next(batches)  # [1] the same replica batch on every stage of replica d
        stage.traced = step == config.timeline_step
        if stage.traced:  # every rank's clock starts at (nearly) the same moment
            wait_for(dist.barrier(async_op=True), config.timeout, f"{stage.who}: barrier before step {step}")
            recorder.reset()
        start = clock()
        count = batch["label_token_weights"].sum().to(torch.float64)
        wait_for(dist.all_reduce(count, group=pm.group("dp"), async_op=True), config.timeout,
                 f"{stage.who}: token count of step {step}")
        optimizer.zero_grad(set_to_none=True)
        # [2] the global token count / dp: the dp group's mean gradient is the global token mean's
        loss, held = stage.step(schedule, batch["input_ids"], batch["labels"], batch["label_token_weights"],
                                count / dp)
        gradients.synchronize()  # [3] and [4]
        optimizer.step()  # [5]
        record.append(loss if stage.last else float("nan"), int(count.item()), clock() - start)
        peak = max(peak, held)
    state = ({names.get(id(p), HEAD_COPY): p.detach().cpu().clone() for p in params}
             if config.return_state else None)
    return HybridResult(pm.rank, d, j, config, record, stage.link.bytes_sent, gradients.bytes_dp,
                        gradients.bytes_tied,
                        sum(row.total for row in memory_report(module, optimizer).values()),
                        sum(p.numel() for p in params), peak, state, list(recorder.events))


def run_hybrid_many(rank: int, world_size: int, configs: Sequence[HybridConfig]) -> list[HybridResult]:
    """:func:`run_hybrid` for each config in turn, in one launch (starting ranks costs seconds)."""
    return [run_hybrid(rank, world_size, config) for config in configs]
