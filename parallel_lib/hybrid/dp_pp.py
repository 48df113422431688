"""Data parallelism over pipelines: ranks as a (dp, pp) grid, stages talking by send/recv.

Data parallelism (chapter 01) multiplies throughput but every rank holds the whole
model; a pipeline (chapter 04) splits the model but one batch keeps only p devices
busy, minus the bubble. Combined, ``dp`` replicas of a ``pp``-stage pipeline use
``dp * pp`` ranks. The layout is a tensor, and every group is a slice of it::

    grid = torch.arange(world_size).reshape(dp, pp)    # grid[d, j]: stage j of replica d

    dp=2, pp=2      stage 0   stage 1
      replica 0        0         1      <- grid[0, :]: one pipeline, activations via send/recv
      replica 1        2         3      <- grid[1, :]
                       ^         ^
              grid[:, 0] = [0, 2]   grid[:, 1] = [1, 3]: the same stage in every replica,
              whose process group averages that stage's gradients (and nothing else)

Each rank runs ``schedule.stages[j]``, the very action list that the threaded
:class:`~parallel_lib.pipeline_parallel.Pipe`, the simulator and the animation of chapter 04
use; only the hand-overs are messages instead of Python objects::

    stage j-1 (rank a)                       stage j (rank b)
    F(i): y = f(x); isend(y, to b)  ------>  x = recv(from a); z = g(x)        [2]
    B(i): g = recv(from b);         <------  backward(z, grad_z); isend(x.grad, to a)
          backward(y, g)

Sends are asynchronous and only receives wait, each with a timeout: the schedule's
validation (every action's inputs come from actions that can run before it) is
what rules out a deadlock. (With NCCL a send may also wait for its receive once a
message outgrows NCCL's buffer, 4 MiB by default; the course's models stay far
below it, and a stuck wait still ends at the timeout.) A training step on rank ``grid[d, j]``:

[1] load replica d's share of the global batch (``partition_dataset``, chapter 01)
    and all-reduce its target-token count over the stage's dp group;
[2] run the stage's actions in schedule order;
[3] sum the gradients of GPT-2's tied embedding between the replica's first and last
    stage (the head's copy lives there, see :mod:`parallel_lib.pipeline_parallel.gpt2`);
[4] average the stage's gradients over its dp group;
[5] take the optimizer step.

One process training on the same global batches gets the same parameters:
:func:`compare_with_reference` checks it against ``dp.single_process_reference``.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from parallel_lib.common.models import GPT2_SIZES
from parallel_lib.common.timeline import Event, TimelineRecorder
from parallel_lib.common.training import weighted_cross_entropy
from parallel_lib.data.partition import partition_dataset
from parallel_lib.data_parallel.allreduce import grad_or_zeros
from parallel_lib.data_parallel.dp import DPConfig, prepare_replica
from parallel_lib.data_parallel.ring import require_process_group
from parallel_lib.hybrid.grid import RankGrid
from parallel_lib.model_parallel.memory import memory_report
from parallel_lib.pipeline_parallel.gpt2 import gpt2_stages
from parallel_lib.pipeline_parallel.schedule import SCHEDULES, Schedule, make_schedule
from parallel_lib.runtime.device import rank_device

__all__ = ["HybridConfig", "HybridResult", "run_hybrid", "run_hybrid_many", "summarize",
           "gather_state", "compare_with_reference", "HEAD_COPY"]

HEAD_COPY = "lm_head.weight"  # the last stage's copy of the tied embedding, by the unsplit model's name


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

    def dp_config(self) -> DPConfig:
        """The chapter 01 config that trains the same model on the same global batches."""
        return DPConfig(sync="none", model=self.model, batch_size=self.batch_size, max_steps=self.steps,
                        train_examples=self.train_examples, vocab_size=self.vocab_size, max_length=self.max_length,
                        pad_to_max_length=self.pad_to_max_length, optimizer=self.optimizer, lr=self.lr,
                        seed=self.seed, data_seed=self.data_seed)

    def check(self, world_size: Optional[int] = None) -> None:
        """Raise ValueError, naming the field, for a run that cannot work (before starting ranks)."""
        grid = RankGrid(self.dp, self.pp)
        if world_size is not None and world_size != grid.world_size:
            raise ValueError(f"dp * pp must equal world_size={world_size}, got dp={self.dp} x pp={self.pp} = "
                             f"{grid.world_size}")
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


@dataclass
class HybridResult:
    """What one rank measured; ``bytes_*`` are payload bytes per step handed to the network by this rank."""

    rank: int
    replica: int
    stage: int
    config: HybridConfig
    step_times: list[float]             # seconds per step on this rank, batch loaded to optimizer step
    tokens: list[int]                   # target tokens of the GLOBAL batch, per step
    losses: list[float]                 # last stage: this replica's share of the global token-mean loss
    bytes_p2p: int                      # activations and gradients sent to neighbouring stages
    bytes_dp: int                       # gradients entering the dp group's all-reduce (0 when dp == 1)
    bytes_tied: int                     # tied-embedding gradient exchanged between first and last stage
    state_bytes: int                    # parameters + gradients + optimizer states held (from the tensors)
    num_parameters: int                 # trainable values on this stage (the head's copy included)
    peak_activations: int               # most micro-batches whose activations the stage held at once
    state: Optional[dict[str, Tensor]] = None
    events: list[Event] = field(default_factory=list)


def _wait(work: Any, timeout: float, what: str) -> None:
    """Wait for a send, receive or collective; its failure names what waited for what.

    Raises:
        TimeoutError: nothing came within ``timeout`` seconds.
        RuntimeError: the peer failed first (gloo reports a closed connection).
    """
    start = time.monotonic()
    try:
        work.wait(timedelta(seconds=timeout))
    except RuntimeError as error:
        waited = time.monotonic() - start
        if waited >= 0.99 * timeout:
            raise TimeoutError(f"{what}: nothing within timeout={timeout:g} s ({error})") from error
        raise RuntimeError(f"{what}: failed after {waited:.1f} s ({error})") from error


class _Stage:
    """One rank's stage for one step: runs its actions, exchanging tensors with its neighbours [2]."""

    def __init__(self, module: nn.Module, grid: RankGrid, rank: int, hidden: int, config: HybridConfig,
                 recorder: TimelineRecorder) -> None:
        self.module, self.config, self.recorder, self.hidden = module, config, recorder, hidden
        self.rank, (self.d, self.j) = rank, grid.coords(rank)
        row = grid.pipeline_ranks(self.d)
        self.prev = row[self.j - 1] if self.j > 0 else None
        self.next = row[self.j + 1] if self.j < grid.pp - 1 else None
        self.lane = f"rank {rank}: replica {self.d}, stage {self.j}"
        self.who = f"rank {rank} (replica {self.d}, stage {self.j})"
        self.traced = False  # record events during this step
        self.bytes_sent = 0  # per step

    def record(self, kind: str, micro_batch: Optional[int], label: str = "") -> Any:
        return self.recorder.record(self.lane, kind, micro_batch, label) if self.traced else nullcontext()

    def _recv(self, shape: tuple[int, ...], src: int, tag: int, what: str) -> Tensor:
        buffer = torch.empty(shape, device=rank_device())
        _wait(dist.irecv(buffer, src=src, tag=tag), self.config.timeout,
              f"{self.who} waiting for {what} from rank {src}")
        return buffer

    def step(self, schedule: Schedule, ids: Tensor, labels: Tensor, weights: Tensor, denominator: Tensor
             ) -> tuple[float, int]:
        """Forward and backward of one replica batch; returns (loss share on the last stage, peak held)."""
        m = schedule.num_micro_batches
        ids_mb, labels_mb, weights_mb = (torch.tensor_split(t, m) for t in (ids, labels, weights))
        saved: dict[int, tuple[Tensor, Tensor]] = {}  # i -> (stage input, stage output or loss)
        sends: list[tuple[Any, Tensor, str]] = []  # kept until the step ends: a gloo send completes
        loss, peak, self.bytes_sent = 0.0, 0, 0      # only once its receiver has posted the receive

        def send(tensor: Tensor, dst: int, tag: int, what: str) -> None:
            tensor = tensor.contiguous()
            sends.append((dist.isend(tensor, dst=dst, tag=tag), tensor, f"{what} to rank {dst}"))
            self.bytes_sent += tensor.numel() * tensor.element_size()

        for action in schedule.stages[self.j]:
            i = action.micro_batch
            shape = (*ids_mb[i].shape, self.hidden)  # hidden states of micro-batch i: (rows, T, C)
            if action.kind == "F":
                # tags: i for activations, m + i for gradients, so messages match whatever their order
                x = ids_mb[i] if self.prev is None else self._recv(
                    shape, self.prev, i, f"the activations of micro-batch {i}").requires_grad_()
                with self.record("forward", i):
                    y = self.module(x)  # (rows, T, C), or logits (rows, T, V) on the last stage
                    if self.next is None:
                        y = weighted_cross_entropy(y, labels_mb[i], weights_mb[i], denominator)
                if self.next is None:
                    loss += y.item()
                else:
                    send(y.detach(), self.next, i, f"the activations of micro-batch {i}")
                saved[i] = (x, y)
                peak = max(peak, len(saved))
            else:
                x, y = saved.pop(i)
                grad = None if self.next is None else self._recv(
                    shape, self.next, m + i, f"the output gradient of micro-batch {i}")
                with self.record("backward", i):
                    torch.autograd.backward(y, grad)
                if self.prev is not None:
                    send(x.grad, self.prev, m + i, f"the input gradient of micro-batch {i}")
        for work, _, what in sends:
            _wait(work, self.config.timeout, f"{self.who} sending {what}")
        return loss, peak


def _all_reduce(tensor: Tensor, group: Any, timeout: float, what: str) -> None:
    _wait(dist.all_reduce(tensor, group=group, async_op=True), timeout, what)


def _new_groups(grid: RankGrid, timeout: float) -> tuple[list[Any], list[Any]]:
    """(dp group of every stage, tied group of every replica); every rank creates all, in one order."""
    wait = timedelta(seconds=timeout)
    dp_groups = [dist.new_group(grid.dp_ranks(j), timeout=wait) for j in range(grid.pp)]
    tied_groups = [dist.new_group(grid.tied_ranks(d), timeout=wait) for d in range(grid.dp)] if grid.pp > 1 else []
    return dp_groups, tied_groups


class _Gradients:
    """Steps [3] and [4]: tied-embedding sum within the replica, then the mean over the dp group."""

    def __init__(self, stage: _Stage, params: list[nn.Parameter], tied: list[nn.Parameter], tied_group: Any,
                 dp_group: Any, dp: int) -> None:
        self.stage, self.params, self.tied, self.dp = stage, params, tied, dp
        self.tied_group, self.dp_group = tied_group, dp_group
        self.bytes_tied = self.bytes_dp = 0

    def synchronize(self) -> None:
        timeout, who = self.stage.config.timeout, self.stage.who
        if len(self.tied) == 2:  # pp == 1: the embedding and the head's copy are both here
            total = self.tied[0].grad + self.tied[1].grad
            for p in self.tied:
                p.grad.copy_(total)
        elif self.tied:
            grad = self.tied[0].grad
            with self.stage.record("comm", None, "tied"):
                _all_reduce(grad, self.tied_group, timeout, f"{who}: tied-embedding gradient sum")
            self.bytes_tied = grad.numel() * grad.element_size()
        if self.dp > 1:  # one flat message per stage and step
            grads = [grad_or_zeros(p) for p in self.params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            with self.stage.record("comm", None, "dp"):
                _all_reduce(flat, self.dp_group, timeout, f"{who}: gradient all-reduce")
            flat /= self.dp
            for g, mean in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(mean.view_as(g))
            self.bytes_dp = flat.numel() * flat.element_size()


def run_hybrid(rank: int, world_size: int, config: HybridConfig = HybridConfig()) -> HybridResult:
    """Train stage j of replica d, for ``grid[d, j] == rank``; the worker function for ``launch``.

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
    grid = RankGrid(config.dp, config.pp)
    d, j = grid.coords(rank)
    dp_groups, tied_groups = _new_groups(grid, config.timeout)
    try:
        device = rank_device()
        model, optimizer, pairs, collate = prepare_replica(config.dp_config(), device)
        names = {id(p): name for name, p in model.named_parameters()}
        stages = gpt2_stages(model, [device] * grid.pp)
        module = stages[j].to(device)
        params = list(module.parameters())
        tied = [p for pair in stages.tied_parameters for p in pair if any(p is q for q in params)]
        optimizer = type(optimizer)(params, lr=config.lr)  # chapter 01's optimizer, on this stage only
        recorder = TimelineRecorder(torch.cuda.synchronize if device.type == "cuda" else None)
        stage = _Stage(module, grid, rank, model.config.n_embd, config, recorder)
        del model, stages  # the other stages' weights are not this rank's to hold
        gradients = _Gradients(stage, params, tied, tied_groups[d] if tied_groups else None, dp_groups[j], grid.dp)
        schedule = make_schedule(config.schedule, grid.pp, config.micro_batches)
        batches = iter(partition_dataset(d, grid.dp, pairs, batch_size=config.batch_size, collate_fn=collate,
                                         seed=config.data_seed))
        times, tokens, losses, peak = [], [], [], 0
        for step in range(config.steps):
            batch = next(batches)  # [1] the same replica batch on every stage of replica d
            stage.traced = step == config.timeline_step
            if stage.traced:
                dist.barrier()  # every rank's clock starts at (nearly) the same moment
                recorder.reset()
            start = time.perf_counter()
            count = batch["label_token_weights"].sum().to(torch.float64)
            _all_reduce(count, dp_groups[j], config.timeout, f"{stage.who}: token count of step {step}")
            optimizer.zero_grad(set_to_none=True)
            # [2] the global token count / dp: the dp group's mean gradient is the global token mean's
            loss, held = stage.step(schedule, batch["input_ids"], batch["labels"], batch["label_token_weights"],
                                    count / grid.dp)
            gradients.synchronize()  # [3] and [4]
            optimizer.step()  # [5]
            times.append(time.perf_counter() - start)
            tokens.append(int(count.item()))
            losses.append(loss)
            peak = max(peak, held)
        state = ({names.get(id(p), HEAD_COPY): p.detach().cpu().clone() for p in params}
                 if config.return_state else None)
        return HybridResult(rank, d, j, config, times, tokens, losses if stage.next is None else [],
                            stage.bytes_sent, gradients.bytes_dp, gradients.bytes_tied,
                            sum(row.total for row in memory_report(module, optimizer).values()),
                            sum(p.numel() for p in params), peak, state, list(recorder.events))
    finally:  # a later run in the same ranks makes new groups
        for group in dp_groups + tied_groups:
            dist.destroy_process_group(group)


def run_hybrid_many(rank: int, world_size: int, configs: Sequence[HybridConfig]) -> list[HybridResult]:
    """:func:`run_hybrid` for each config in turn, in one launch (starting ranks costs seconds)."""
    return [run_hybrid(rank, world_size, config) for config in configs]


def summarize(results: Sequence[HybridResult], warmup: int = 1) -> dict[str, Any]:
    """The job's numbers from every rank's result: a step lasts as long as its slowest rank.

    Args:
        results: one :class:`HybridResult` per rank, in rank order (``launch``'s return value).
        warmup: first steps left out of the throughput.
    """
    config = results[0].config
    step_times = [max(r.step_times[k] for r in results) for k in range(config.steps)]
    tokens = results[0].tokens
    seconds = sum(step_times[warmup:])
    last = [r for r in results if r.stage == config.pp - 1]
    return dict(layout=f"{config.dp} x {config.pp}", dp=config.dp, pp=config.pp, schedule=config.schedule,
                micro_batches=config.micro_batches, ranks=len(results), step_times=step_times,
                tokens_per_sec=sum(tokens[warmup:]) / seconds if seconds > 0 else float("nan"),
                losses=[sum(r.losses[k] for r in last) / config.dp for k in range(config.steps)],
                bytes_p2p=max(r.bytes_p2p for r in results), bytes_dp=max(r.bytes_dp for r in results),
                bytes_tied=max(r.bytes_tied for r in results), state_bytes=max(r.state_bytes for r in results),
                peak_activations=max(r.peak_activations for r in results))


def gather_state(results: Sequence[HybridResult], replica: int = 0) -> dict[str, Tensor]:
    """The parameters of one replica, stage by stage, by the unsplit model's names.

    Raises:
        ValueError: the runs did not return their state (``return_state=False``).
    """
    state: dict[str, Tensor] = {}
    for r in results:
        if r.replica == replica:
            if r.state is None:
                raise ValueError("results hold no parameters: run with HybridConfig(return_state=True)")
            state.update(r.state)
    return state


def compare_with_reference(results: Sequence[HybridResult], reference: dict[str, Tensor]) -> dict[str, float]:
    """Largest absolute difference per parameter between every replica and a reference ``state_dict``.

    The head's copy (``HEAD_COPY``) is compared with the reference's ``lm_head.weight``,
    which in the tied reference is the embedding itself.

    Raises:
        ValueError: a replica misses one of the reference's parameters, or results hold no state.
    """
    differences: dict[str, float] = {}
    for d in sorted({r.replica for r in results}):
        state = gather_state(results, d)
        for name, tensor in state.items():
            diff = (tensor - reference[name].cpu()).abs().max().item()
            differences[name] = max(differences.get(name, 0.0), diff)
    missing = [name for name in reference if name not in differences]
    if missing:
        raise ValueError(f"no stage holds the reference's parameters {missing}")
    return differences
