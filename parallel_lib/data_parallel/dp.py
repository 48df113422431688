"""Data-parallel training of GPT-2 on the offline German→English corpus.

Every rank builds the same replica (same seed), loads its own shard of each global
batch (``partition_dataset``) and, after backward, synchronises gradients with one
of ``SYNC_METHODS``. ``none`` skips the synchronisation: the replicas then drift
apart, which is the answer to "why do ranks have to talk?".

**Loss normalisation.** The loss is a mean over target tokens, and ranks hold
different numbers of them. Averaging each rank's own mean (the classic tutorial)
weights a token on a rank with few tokens more than one on a busy rank, so N
ranks would not train like one process on the same global batch. Here every rank
first all-reduces its token count (one 8-byte message) and divides its loss sum by
``global_tokens / world_size``; the gradient *mean* over ranks that every sync
method computes is then exactly the gradient of the global batch's token mean.
:func:`~parallel_lib.data_parallel.dp_reference.single_process_reference` trains one process on those global batches with
the plain ``parallel_lib.common.training.train`` loop, and the two agree to float precision.

**Timing.** Per step, :attr:`DPResult.local` records the phases data, compute, sync,
optimizer and gc. CUDA kernels run asynchronously, so a host clock alone would end "compute"
when backward was queued, and synchronising the device between phases would stall the host
and hide the overlap the step has. So the phase boundaries are stamps of the rank's
:class:`~parallel_lib.common.timeline.TimelineRecorder`: on a GPU, CUDA events on the stream
that computes, read once the step has ended (its loss read waits for it anyway): "compute"
ends when the device has run backward, "sync" is the all-reduce time backward did not hide,
and "data" is the time the device waited for the batch (0 when loading overlapped the
previous step's kernels). On a CPU they are host clock readings. The timeline of the first
``timeline_steps`` steps is stamped the same way (a bucket's all-reduce ends when it has run,
see :class:`~parallel_lib.data_parallel.allreduce.BucketedAllReduce`), so it shows the
all-reduces overlapping backward as they did. Epoch times wait for the device
(:class:`~parallel_lib.common.timeline.DeviceClock`), between epochs.

Run from a notebook with ``launch(run_dp, world_size, DPConfig(...))``, or from a shell
(:mod:`parallel_lib.data_parallel.cli`)::

    python -m parallel_lib.data_parallel --world-size 2 --sync bucketed [--save run.pt]
    torchrun --nproc-per-node 2 -m parallel_lib.data_parallel --sync ddp
"""

from __future__ import annotations

import gc
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from parallel_lib.common.checks import check_choice
from parallel_lib.common.models import GPT2_SIZES, build_gpt2
from parallel_lib.common.timeline import DeviceClock, Event, TimelineRecorder
from parallel_lib.common.training import TrainRecord, evaluate, weighted_cross_entropy
from parallel_lib.data.corpus import load_corpus
from parallel_lib.data.partition import partition_dataset
from parallel_lib.data.tokenizer import collate_batch, get_tokenizer
from parallel_lib.data_parallel.allreduce import BucketedAllReduce, average_gradients
from parallel_lib.data_parallel.ring import ring_all_reduce
from parallel_lib.runtime.device import rank_device

__all__ = ["SYNC_METHODS", "PHASES", "DPConfig", "DPResult", "prepare_replica", "run_dp", "run_dp_many",
           "train_replica"]

SYNC_METHODS = ("none", "naive", "bucketed", "ring", "ddp")
# where a step's time goes on one rank (``DPResult.local.phases``); gc overlaps the others
PHASES = ("data", "compute", "sync", "optimizer", "gc")


@dataclass(frozen=True)
class DPConfig:
    """One data-parallel run; every rank gets the same config."""

    sync: str = "bucketed"             # one of SYNC_METHODS
    model: str = "tiny"                # a models.GPT2_SIZES name, on every device ("gpt2": the real 124M shape)
    batch_size: int = 32               # the GLOBAL batch; each rank loads batch_size // world_size
    epochs: int = 1
    max_steps: Optional[int] = None    # steps per epoch (None: the whole shard)
    train_examples: Optional[int] = 2048  # first pairs of the train split (None: all 18,000)
    val_examples: int = 256
    vocab_size: int = 2048
    max_length: int = 64               # positions per row
    pad_to_max_length: bool = False    # same shape every step: steadier timings for benchmarks
    optimizer: str = "adamw"           # "adamw" or "sgd"
    lr: float = 1e-3
    seed: int = 0                      # weight init, the same on every rank
    data_seed: int = 1234              # shuffle of partition_dataset
    bucket_cap_mb: float = 25.0        # bucketed, ring and ddp
    overlap: bool = True               # bucketed: all-reduce from gradient hooks during backward
    timeline_steps: int = 0            # record forward/backward/comm events of the first steps
    return_state: bool = False         # send the final parameters back (tests, drift plots)


@dataclass
class DPResult:
    """What one rank measured. ``record`` is the job's view and equal on every rank.

    ``record`` counts the global batch's target tokens per step, the slowest rank's step
    time and the global token-mean loss; ``local`` is this rank's own shard and times,
    each step split into :data:`PHASES` (``local.phases``, also as :attr:`breakdown`).
    """

    rank: int
    world_size: int
    config: DPConfig
    model: str
    device: str
    record: TrainRecord
    local: TrainRecord
    epoch_times: list[float]           # seconds per epoch on this rank, data loading included
    val_loss: float                    # this rank's replica on the validation pairs
    checksum: float                    # sum of all parameters (float64): equal ranks, equal sums
    state: Optional[dict[str, torch.Tensor]] = None
    events: list[Event] = field(default_factory=list)

    @property
    def breakdown(self) -> dict[str, list[float]]:
        """Seconds per step on this rank by phase (:data:`PHASES`): ``local.phases``."""
        return self.local.phases


def _check_config(config: DPConfig) -> None:
    if config.sync not in SYNC_METHODS:
        raise ValueError(f"sync must be one of {SYNC_METHODS}, got sync={config.sync!r}")
    check_choice("model", config.model, sorted(GPT2_SIZES))
    if config.optimizer not in ("adamw", "sgd"):
        raise ValueError(f"optimizer must be 'adamw' or 'sgd', got optimizer={config.optimizer!r}")
    for name in ("epochs", "batch_size", "max_length", "val_examples"):
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {name}={getattr(config, name)!r}")


def prepare_replica(config: DPConfig, device: torch.device
                    ) -> tuple[nn.Module, torch.optim.Optimizer, list, Callable]:
    """The replica, its optimizer, the training pairs and the collate function (same on every rank)."""
    _check_config(config)
    pairs = load_corpus("train", size=config.train_examples)
    tokenizer = get_tokenizer(pairs, vocab_size=config.vocab_size)
    model = build_gpt2(config.model, vocab_size=len(tokenizer), seed=config.seed).to(device)
    if config.max_length > model.config.n_positions:
        raise ValueError(f"max_length must be <= the model's n_positions={model.config.n_positions}, "
                         f"got max_length={config.max_length}")
    optimizer_class = torch.optim.AdamW if config.optimizer == "adamw" else torch.optim.SGD
    optimizer = optimizer_class(model.parameters(), lr=config.lr)
    collate = partial(collate_batch, src_key="de", tgt_key="en", tokenizer=tokenizer,
                      model_max_length=config.max_length, device=device, pad_to_max_length=config.pad_to_max_length)
    return model, optimizer, pairs, collate


def _sync_method(config: DPConfig, model: nn.Module, device: torch.device
                 ) -> tuple[nn.Module, Optional[Callable[[nn.Module], None]]]:
    """(the module to call forward on, the function that averages gradients after backward)."""
    cap = config.bucket_cap_mb
    if config.sync == "naive":
        return model, average_gradients
    if config.sync == "bucketed":
        return model, BucketedAllReduce(model, bucket_cap_mb=cap, overlap=config.overlap)
    if config.sync == "ring":
        return model, BucketedAllReduce(model, bucket_cap_mb=cap, overlap=False, all_reduce=ring_all_reduce)
    if config.sync == "ddp":  # DDP averages inside backward, from its own hooks
        return DistributedDataParallel(model, bucket_cap_mb=cap,
                                       device_ids=[device] if device.type == "cuda" else None), None
    return model, None  # "none"


class _GCClock:
    """Seconds the garbage collector ran since the last ``take()`` (a source of timing spikes)."""

    def __init__(self) -> None:
        self.total, self._start = 0.0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._start

    def take(self) -> float:
        total, self.total = self.total, 0.0
        return total


def train_replica(rank: int, world_size: int, config: DPConfig) -> DPResult:
    """This rank's training loop alone: ``run_dp`` without the job-wide ``record`` (left empty).

    With ``sync="none"`` it sends no message at all, so one rank of a larger group
    can train alone (the benchmark's one-rank baseline). Arguments as :func:`run_dp`.
    """
    device = rank_device()
    model, optimizer, pairs, collate = prepare_replica(config, device)
    net, sync = _sync_method(config, model, device)
    loader = partition_dataset(rank, world_size, pairs, batch_size=config.batch_size, collate_fn=collate,
                               seed=config.data_seed)
    clock = DeviceClock([device])  # epochs; this rank's device only: another rank's GPU is not ours to wait for
    recorder = TimelineRecorder(device=device)  # phases and timeline; a GPU: CUDA events on its streams
    lane = f"rank {rank}"
    local, epoch_times = TrainRecord(), []
    if config.timeline_steps and world_size > 1:
        dist.barrier()  # every rank's timeline starts at (nearly) the same moment
    recorder.reset()
    gc_clock = _GCClock()
    gc.callbacks.append(gc_clock)
    try:
        for epoch in range(config.epochs):
            loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
            epoch_start = clock()
            batches = iter(loader)
            for _ in range(min(len(loader), config.max_steps or len(loader))):
                t0 = recorder.stamp()  # no wait inside the step: read once it has ended
                batch = next(batches)
                t1 = recorder.stamp()
                local_tokens = int(batch["label_token_weights"].sum().item())
                denominator = torch.tensor(float(local_tokens), dtype=torch.float64, device=device)
                # [1] the global token count, so that the mean is global. Sent now and awaited
                # only after forward: the message travels while the model computes, and the
                # ranks meet once per step (at the gradients), not twice.
                counting = (dist.all_reduce(denominator, op=dist.ReduceOp.SUM, async_op=True)
                            if config.sync != "none" else None)
                global_step = len(local.losses)  # the events' micro_batch, as BucketedAllReduce's steps
                traced = global_step < config.timeline_steps
                if isinstance(sync, BucketedAllReduce):
                    sync.recorder = recorder if traced else None
                optimizer.zero_grad(set_to_none=True)
                with recorder.record(lane, "forward", global_step) if traced else nullcontext():
                    logits = net(batch["input_ids"]).logits  # (B, T, V)
                    if counting is not None:
                        counting.wait()
                        denominator /= world_size
                    loss = weighted_cross_entropy(logits, batch["labels"], batch["label_token_weights"], denominator)
                with recorder.record(lane, "backward", global_step) if traced else nullcontext():
                    loss.backward()  # [2] ddp and overlapping buckets start all-reducing in here
                t2 = recorder.stamp()  # a GPU: when backward has run on the device, not when it was queued
                if sync is not None:
                    sync(model)  # [3] the other methods all-reduce here; overlapping ones only wait
                t3 = recorder.stamp()
                optimizer.step()
                t4 = recorder.stamp()
                loss_sum = loss.item() * denominator.item()  # this rank's sum of ce * weight; the step is over
                t0, t1, t2, t3, t4 = (recorder.seconds(t) for t in (t0, t1, t2, t3, t4))
                local.append(loss_sum / max(local_tokens, 1), local_tokens, t4 - t1,
                             dict(zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, gc_clock.take()))))
            epoch_times.append(clock() - epoch_start)
    finally:
        gc.callbacks.remove(gc_clock)
        if isinstance(sync, BucketedAllReduce):
            sync.remove()
    val_batches = [collate(chunk) for chunk in _chunks(load_corpus("validation", size=config.val_examples), 64)]
    params = [p.detach() for p in model.parameters()]
    return DPResult(rank, world_size, config, config.model, str(device), record=TrainRecord(),
                    local=local, epoch_times=epoch_times, val_loss=evaluate(model, val_batches),
                    checksum=float(sum(p.double().sum() for p in params)),
                    state={k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
                    if config.return_state else None,
                    events=list(recorder.events))


def _chunks(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def _job_record(local: TrainRecord, device: torch.device) -> TrainRecord:
    """The whole job's per-step record: summed tokens and loss sums, the slowest rank's time."""
    sums = torch.tensor([[loss * tokens for loss, tokens in zip(local.losses, local.tokens)], local.tokens],
                        dtype=torch.float64, device=device)  # (2, steps)
    slowest = torch.tensor(local.step_times, dtype=torch.float64, device=device)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    loss_sums, tokens = sums.tolist()
    return TrainRecord.from_steps([s / max(t, 1) for s, t in zip(loss_sums, tokens)], [int(t) for t in tokens],
                                  slowest.tolist())


def run_dp(rank: int, world_size: int, config: DPConfig = DPConfig()) -> DPResult:
    """Train one data-parallel replica; the worker function for ``launch`` and torchrun.

    Args:
        rank: this rank, in ``[0, world_size)``.
        world_size: number of ranks in the (initialised) default process group.
        config: the run; the same on every rank.

    Returns:
        This rank's :class:`DPResult`; ``record`` is the whole job's and equal on all ranks.

    Raises:
        RuntimeError: no initialised process group.
        ValueError: a bad ``config`` field (named in the message).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("run_dp needs an initialised process group: run it with "
                           "parallel_lib.runtime.launcher(run_dp, world_size, config) or under torchrun")
    result = train_replica(rank, world_size, config)
    result.record = _job_record(result.local, rank_device())
    return result


def run_dp_many(rank: int, world_size: int, configs: Sequence[DPConfig]) -> list[DPResult]:
    """:func:`run_dp` for each config in turn, in one launch (starting ranks costs seconds)."""
    return [run_dp(rank, world_size, config) for config in configs]
