"""Averaging gradients across data-parallel ranks: the classic loop, then buckets.

After ``loss.backward()`` every rank holds the gradient of its own shard of the
batch; averaging them over ranks gives every replica the gradient of the whole
batch, so the replicas take identical optimizer steps and stay identical.

- :func:`average_gradients` is the classic tutorial's version, kept for
  understanding: one blocking ``all_reduce`` per parameter. A GPT-2 has ~150
  parameter tensors, so it pays ~150 latencies per step and communicates only
  after the whole backward pass has finished.
- :class:`BucketedAllReduce` does what ``DistributedDataParallel`` does: it packs
  gradients into flat buckets of ``bucket_cap_mb`` (25 MB by default, as DDP),
  so there are a few large messages instead of many small ones, and with
  ``overlap=True`` it starts a bucket's all-reduce from a gradient hook as soon as
  backward has produced the bucket's last gradient. Buckets fill in reverse
  layer order, so the last layers' communication runs while the first layers'
  backward is still computing. Any all-reduce can fill a bucket, e.g. the
  hand-written :func:`parallel_lib.data_parallel.ring.ring_all_reduce`.

The ring algorithm and the cost model live in :mod:`parallel_lib.data_parallel.ring` and are
re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from parallel_lib.common.timeline import Stamp, TimelineRecorder
from parallel_lib.data_parallel.buckets import make_buckets
from parallel_lib.data_parallel.ring import require_process_group

__all__ = ["grad_or_zeros", "average_gradients", "BucketedAllReduce"]

AllReduceFn = Callable[[torch.Tensor], Any]  # sums a tensor over ranks in place, blocking


def grad_or_zeros(param: nn.Parameter) -> torch.Tensor:
    """``param.grad``, made zeros first when backward gave it none."""
    # a parameter that got no gradient on this rank still joins the collective, as zeros:
    # skipping it would leave the other ranks waiting for a message that never comes
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return param.grad


def average_gradients(model: nn.Module) -> None:
    """Replace each parameter's gradient by its mean over ranks, one all-reduce per parameter.

    The classic tutorial's loop, for understanding; :class:`BucketedAllReduce` is the fast one.

    Raises:
        RuntimeError: no initialised process group.
    """
    require_process_group("average_gradients")
    world_size = dist.get_world_size()
    for param in model.parameters():
        if param.requires_grad:
            grad = grad_or_zeros(param)
            dist.all_reduce(grad, op=dist.ReduceOp.SUM)
            grad /= world_size


@dataclass
class _Bucket:
    """Parameters whose gradients travel together in one flat buffer."""

    params: list[nn.Parameter]
    buffer: torch.Tensor                      # (sum of numels,) flat, one dtype and device
    ready: set[int] = field(default_factory=set)  # ids of params whose gradient is final
    work: Optional[Any] = None                # the async all-reduce in flight, if any
    stamped: Optional[Any] = None             # a future done once ``end`` is set (gloo: from the work's callback)
    launched: bool = False
    start: Stamp = 0.0                        # recorder stamps of the all-reduce (with a recorder)
    end: Optional[Stamp] = None


class BucketedAllReduce:
    """Average gradients over ranks in flat buckets, optionally overlapping backward.

    Use it in place of :func:`average_gradients`: call it (or :meth:`synchronize`)
    after ``loss.backward()`` and before ``optimizer.step()``. With ``overlap=True``
    buckets whose gradients are all final are already on the wire by then, and the
    call only waits for them and launches the rest.

    Args:
        model: the replica; its parameters are bucketed in reverse registration
            order, roughly the order in which backward produces their gradients
            (:func:`~parallel_lib.data_parallel.buckets.make_buckets`).
        bucket_cap_mb: largest bucket in megabytes (2**20 bytes); a parameter larger
            than the cap gets a bucket of its own.
        overlap: launch each bucket from gradient hooks as soon as it is full.
        all_reduce: a blocking in-place SUM over ranks (e.g. ``ring_all_reduce``);
            default ``dist.all_reduce``, launched asynchronously.
        timeout: seconds to wait for a bucket's all-reduce; default the group's timeout.
        recorder: if given, each bucket's all-reduce is recorded as a "comm" event on
            lane "rank R comm" from its launch to its completion, with ``micro_batch`` the
            step (the number of earlier synchronize calls) and label "b<bucket index>". The
            ``recorder`` attribute may be changed between steps (None: record nothing).
            Completion means the sums are in the bucket on its device: on a CPU, when gloo
            completes the work (its future's callback reads the host clock); on a GPU, a CUDA
            event that waits for the all-reduce alone (:meth:`TimelineRecorder.stamp_done`;
            NCCL completes a work's future when its kernel is queued, so it dates nothing),
            read after the step: nothing synchronises the device. A GPU rank's recorder is
            ``TimelineRecorder(device=<the rank's GPU>)``.
        group: the process group to average over (default: every rank), e.g. the ranks that
            hold the same pipeline stage in data parallelism over pipelines (chapter 05).

    Raises:
        ValueError: ``bucket_cap_mb`` not positive, a model without trainable parameters, or
            both ``all_reduce`` and ``group`` (a custom all-reduce picks its ranks itself);
            at the first bucket, a recorder that does not time the GPU the buckets live on.
    """

    def __init__(self, model: nn.Module, bucket_cap_mb: float = 25.0, overlap: bool = True,
                 all_reduce: Optional[AllReduceFn] = None, timeout: Optional[float] = None,
                 recorder: Optional[TimelineRecorder] = None, group: Optional[Any] = None) -> None:
        if all_reduce is not None and group is not None:
            raise ValueError("give all_reduce or group, not both: a custom all_reduce sums over the ranks it "
                             "chooses itself")
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got bucket_cap_mb={bucket_cap_mb!r}")
        params = [p for p in model.parameters() if p.requires_grad][::-1]
        if not params:
            raise ValueError("model has no trainable parameters to synchronise")
        self.bucket_cap_mb = bucket_cap_mb
        self.overlap = overlap
        self._all_reduce = all_reduce
        self.group = group
        self._wait = {} if timeout is None else {"timeout": timedelta(seconds=timeout)}
        self.recorder = recorder
        self.steps = 0  # completed synchronize calls
        self.buckets = [_Bucket(g, torch.empty(sum(p.numel() for p in g), dtype=g[0].dtype, device=g[0].device))
                        for g in make_buckets(params, int(bucket_cap_mb * 2**20))]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._hooks = ([p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]
                       if overlap else [])

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        """Gradient hook: ``param.grad`` is final for this backward; launch its bucket once full."""
        bucket = self._bucket_of[id(param)]
        if bucket.launched:
            raise RuntimeError("a second backward ran before synchronize(): call the BucketedAllReduce "
                               "after every backward (gradient accumulation is not supported)")
        bucket.ready.add(id(param))
        if len(bucket.ready) == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        offset = 0
        for p in bucket.params:  # [1] pack: copy each gradient into its slice of the flat buffer
            n = p.numel()
            bucket.buffer[offset:offset + n].copy_(grad_or_zeros(p).reshape(-1))
            offset += n
        recorder = self.recorder
        if recorder:
            device = bucket.buffer.device
            if device.type == "cuda" and recorder.device != device:
                raise ValueError(f"the recorder times device={recorder.device}, the buckets live on {device}: "
                                 f"build it with TimelineRecorder(device={str(device)!r})")
            bucket.start, bucket.end = recorder.stamp(), None  # a GPU: when the compute stream got here
        if self._all_reduce is None:  # [2] reduce: in the background; synchronize() waits
            bucket.work = dist.all_reduce(bucket.buffer, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            if recorder:
                bucket.end = recorder.stamp_done(bucket.work)  # a GPU: an event once the all-reduce has run
            if recorder and bucket.end is None:  # a CPU: gloo completes the future once the sums are in
                # the callback runs when the all-reduce completes, not when synchronize() looks
                def stamp(_: Any) -> None:
                    bucket.end = recorder.now()

                bucket.stamped = bucket.work.get_future().then(stamp)
        else:
            self._all_reduce(bucket.buffer)  # blocking on the host; on a GPU it made the current stream wait
            if recorder:
                bucket.end = recorder.stamp()
        bucket.launched = True

    def synchronize(self) -> None:
        """Finish every bucket's all-reduce and write the mean gradients back into ``.grad``.

        Raises:
            RuntimeError: no initialised process group, or a bucket's all-reduce failed or timed out.
        """
        require_process_group("BucketedAllReduce")
        world_size = dist.get_world_size(self.group)
        try:
            for i, bucket in enumerate(self.buckets):
                if not bucket.launched:  # overlap=False, or parameters that got no gradient
                    self._launch(bucket)
                if bucket.work is not None:
                    bucket.work.wait(**self._wait)
                if self.recorder:
                    if bucket.stamped is not None:
                        bucket.stamped.wait()  # the callback that set ``end`` has finished
                    if bucket.end is not None:  # None: launched before the recorder was set
                        self.recorder.add_stamped(f"rank {dist.get_rank()} comm", "comm", self.steps, bucket.start,
                                                  bucket.end, f"b{i}")
                bucket.buffer /= world_size
                offset = 0
                for p in bucket.params:  # [3] unpack: the mean back into each gradient
                    n = p.numel()
                    p.grad.copy_(bucket.buffer[offset:offset + n].view_as(p.grad))  # type: ignore[union-attr]
                    offset += n
            self.steps += 1
        finally:  # the next backward starts with empty buckets, also after an error
            for bucket in self.buckets:
                bucket.ready.clear()
                bucket.work = bucket.stamped = bucket.end = None
                bucket.launched = False

    def __call__(self, model: Optional[nn.Module] = None) -> None:
        """:meth:`synchronize`; takes (and ignores) ``model`` to fit ``average_gradients_fn(model)``."""
        self.synchronize()

    def remove(self) -> None:
        """Unregister the gradient hooks (the model then trains without them)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def __enter__(self) -> BucketedAllReduce:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
