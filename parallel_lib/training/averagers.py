"""Chapter 01's gradient averagers as the dp axis of the one training entry (``Plan.sync``).

Chapter 01 teaches data parallelism as "every replica steps its own optimizer on the mean of
the replicas' gradients", and chapter 02 makes the mean faster. The averagers themselves are
the chapters' lesson code and stay in :mod:`parallel_lib.data_parallel`; this file only hands
them to :func:`~parallel_lib.training.run.train` as the axis it drives every step
(:mod:`.data_axis`)::

    "naive"     average_gradients: one blocking all-reduce per parameter, after backward
    "bucketed"  BucketedAllReduce: flat buckets of run.bucket_cap_mb, launched from backward's
                gradient hooks when run.overlap (the all-reduce overlaps backward)
    "ring"      BucketedAllReduce whose buckets go through chapter 02's ring_all_reduce
    "ddp"       PyTorch's DistributedDataParallel wraps the stage (its own hooks and buckets;
                built by :mod:`.torch_sharding`, which chapter 06 shares, with ``run.optimizer``)
    "none"      nothing: the replicas drift apart (chapter 01's "why must ranks talk?", and
                the benchmark's one-rank baseline)

Each replica keeps the whole stage and its own optimizer (``run.optimizer``: AdamW, or SGD,
whose update is proportional to the gradient, so a wrong scale shows). The averagers reduce over
the dp axis's group, so ``bucketed``, ``ddp`` and ``none`` also run beside tensor and pipeline
parallelism; ``naive`` and ``ring`` are chapter 01/02's versions over every rank of the job.
:func:`check_averager` says, before any rank starts, which plans an averager cannot run (named by
field).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional

import torch
from torch import nn

from parallel_lib.common.timeline import TimelineRecorder
from parallel_lib.data_parallel.allreduce import BucketedAllReduce, average_gradients, grad_or_zeros
from parallel_lib.data_parallel.ring import ring_all_reduce
from parallel_lib.runtime.mesh import RankMesh
from parallel_lib.sharding.memory import optimizer_tensors, storage_census

__all__ = ["AVERAGERS", "OPTIMIZERS", "AveragingAxis", "make_optimizer", "check_averager", "check_optimizer",
           "averager_axis"]

AVERAGERS = ("naive", "bucketed", "ring", "ddp", "none")
OPTIMIZERS = ("adamw", "sgd")
# averagers that reduce over every rank of the job (the default group), not over the dp axis's group
WHOLE_WORLD = ("naive", "ring")
# averagers that start reducing inside backward, from gradient hooks, and refuse a second backward per step
IN_BACKWARD = ("bucketed",)


def make_optimizer(run: Any, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """``run.optimizer`` over ``params``: AdamW with the run's lr, eps and weight decay, or plain SGD with its lr."""
    if run.optimizer == "sgd":
        return torch.optim.SGD(params, lr=run.lr)
    return torch.optim.AdamW(params, lr=run.lr, eps=run.eps, weight_decay=run.weight_decay)


class AveragingAxis:
    """The dp axis of replicas that average their gradients, then step their own optimizer.

    Args:
        stage: this rank's stage (the whole model with one stage and one tensor slice).
        average: called after the pipeline's backward (None: the gradients are already the
            mean, DDP's, or are left alone, ``"none"``).
        optimizer: over every trainable parameter of ``stage``.
        buckets: the :class:`BucketedAllReduce` behind ``average``, if any (its hooks and timeline).
    """

    def __init__(self, stage: nn.Module, average: Optional[Callable[[nn.Module], None]],
                 optimizer: torch.optim.Optimizer, buckets: Optional[BucketedAllReduce] = None) -> None:
        self.model, self.average, self.optimizer, self.buckets = stage, average, optimizer, buckets
        self.master = [p for p in stage.parameters() if p.requires_grad]  # what this rank's optimizer updates

    def trace(self, recorder: Optional[TimelineRecorder]) -> None:
        """Record the buckets' all-reduces of the coming steps as "comm" events on ``recorder`` (None: stop)."""
        if self.buckets is not None:
            self.buckets.recorder = recorder

    def reduce_gradients(self) -> None:
        """The replicas' mean gradient in every ``.grad`` (after the pipeline's backward)."""
        if self.average is not None:
            self.average(self.model)

    def reduced_gradient(self, param: nn.Parameter) -> torch.Tensor:
        """``param``'s averaged gradient (zeros if backward gave it none)."""
        return grad_or_zeros(param)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """torch's own clip of the averaged gradients (every replica holds all of them)."""
        return torch.nn.utils.clip_grad_norm_(self.master, max_norm)

    def step(self) -> None:
        """This replica's optimizer step; the gradients are cleared for the next step."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def census(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer states this rank holds (the whole stage's)."""
        params = list(self.model.parameters())
        return storage_census(params, [p.grad for p in params], optimizer_tensors(self.optimizer))

    def remove(self) -> None:
        """Unregister the buckets' gradient hooks (the stage then trains without them)."""
        if self.buckets is not None:
            self.buckets.remove()


def averager_axis(plan: Any, run: Any, stage: nn.Module, pm: RankMesh) -> tuple[nn.Module, AveragingAxis]:
    """``plan.sync``'s averager over ``pm.group("dp")`` for this rank's ``stage`` (a ``SYNCS`` entry).

    Returns:
        The module the pipeline runtime runs (the stage) and the axis.
    """
    group, cap = pm.group("dp"), run.bucket_cap_mb
    optimizer = make_optimizer(run, [p for p in stage.parameters() if p.requires_grad])
    if plan.sync == "none":
        return stage, AveragingAxis(stage, None, optimizer)
    if plan.sync == "naive":
        return stage, AveragingAxis(stage, average_gradients, optimizer)
    if plan.sync == "ring":  # chapter 02's ring blocks: its buckets leave after backward, as chapter 02 runs them
        buckets = BucketedAllReduce(stage, bucket_cap_mb=cap, overlap=False,
                                    all_reduce=partial(ring_all_reduce, timeout=run.timeout))
    elif plan.sync == "bucketed":
        buckets = BucketedAllReduce(stage, bucket_cap_mb=cap, overlap=run.overlap, timeout=run.timeout, group=group)
    else:  # "ddp" is data_axis's (PyTorch's own wrapper, shared with chapter 06)
        raise ValueError(f"averager_axis builds {[s for s in AVERAGERS if s != 'ddp']}, got sync={plan.sync!r}")
    return stage, AveragingAxis(stage, buckets, optimizer, buckets)


def check_averager(plan: Any) -> None:
    """Refuse, naming the field, a plan whose ``sync`` is one of :data:`AVERAGERS` and cannot run it.

    Raises:
        ValueError: ``naive`` or ``ring`` with ``tp`` or ``pp`` > 1 (they average over every rank of the
            job, not over the dp axis); ``bucketed`` with ``micro_batches`` > 1 (it reduces from
            backward's gradient hooks: one backward per step). (``Plan.check`` refuses ``zero`` > 0
            with every sync but ``"zero"``.)
    """
    if plan.sync not in AVERAGERS:
        return
    if plan.sync in WHOLE_WORLD:
        for axis in ("tp", "pp"):
            if getattr(plan, axis) > 1:
                raise ValueError(f"sync={plan.sync!r} averages over every rank of the job, not over the dp axis: "
                                 f"it needs {axis}=1, got {axis}={getattr(plan, axis)}; use sync='bucketed' or "
                                 f"'zero' with tensor or pipeline parallelism")
    if plan.sync in IN_BACKWARD and plan.micro_batches > 1:
        raise ValueError(f"sync={plan.sync!r} all-reduces from backward's gradient hooks, once per backward: it "
                         f"needs micro_batches=1, got micro_batches={plan.micro_batches}")


def check_optimizer(plan: Any, run: Any) -> None:
    """Refuse ``run.optimizer`` values the plan's dp axis does not run.

    Raises:
        ValueError: ``"sgd"`` with a sync that is not one of :data:`AVERAGERS` (ZeRO's engines step AdamW).
    """
    if run.optimizer != "adamw" and plan.sync not in AVERAGERS:
        raise ValueError(f"optimizer={run.optimizer!r} runs with chapter 01's averagers (sync in "
                         f"{list(AVERAGERS)}); sync={plan.sync!r} steps AdamW: use optimizer='adamw'")
