"""A stage's gradients in data parallelism over pipelines: steps [3] and [4] of ``dp_pp``.

[3] GPT-2's tied embedding lives on the first stage (the embedding) and the last (the
    head's copy): each copy holds part of the gradient, so they are summed, within the
    replica, over the two ranks that hold them.
[4] Stage j's gradients are averaged over the replicas, in stage j's data-parallel group
    (``grid[:, j]``) only: chapter 01's :class:`~parallel_lib.data_parallel.BucketedAllReduce`
    with ``group=``, the one bucketed all-reduce of the course. Its gradient hooks are off
    (``overlap=False``): a pipeline runs one backward per micro-batch, and a bucket may only
    go once all of them have added to its gradients.

Both are sums and means of the same numbers, so their order does not matter.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Optional

import torch.distributed as dist
from torch import nn

from parallel_lib.data_parallel.allreduce import BucketedAllReduce
from parallel_lib.pipeline_parallel.link import wait_for

__all__ = ["StageGradients"]

Record = Callable[[str, Optional[int], str], ContextManager[Any]]


class StageGradients:
    """Tied-embedding sum within the replica [3], then the mean over the stage's dp group [4].

    Args:
        module: the stage's layers on this rank.
        tied: this rank's copies of the tied embedding (two when one rank holds the whole
            model, one on a first or last stage, none in between).
        tied_group: the replica's first and last rank (None when ``len(tied) != 1``).
        dp_group: the ranks holding this stage in every replica.
        dp: number of replicas.
        who: how errors name this rank.
        timeout: seconds any collective may wait.
        record: ``record(kind, micro_batch, label)``: a context that times a timeline event.
    """

    def __init__(self, module: nn.Module, tied: list[nn.Parameter], tied_group: Any, dp_group: Any, dp: int,
                 who: str, timeout: float, record: Optional[Record] = None) -> None:
        self.tied, self.tied_group, self.who, self.timeout = tied, tied_group, who, timeout
        self.record = record or (lambda kind, micro_batch, label: nullcontext())
        self.average = (BucketedAllReduce(module, overlap=False, timeout=timeout, group=dp_group)
                        if dp > 1 else None)
        self.bytes_tied = 0
        self.bytes_dp = sum(b.buffer.numel() * b.buffer.element_size()
                            for b in self.average.buckets) if self.average else 0  # per step

    def synchronize(self) -> None:
        """Sum the tied copies' gradients [3], then average every gradient over the dp group [4].

        Raises:
            TimeoutError: the tied-embedding sum waited longer than ``timeout``.
            RuntimeError: a collective failed or timed out (naming this rank).
        """
        if len(self.tied) == 2:  # pp == 1: the embedding and the head's copy are both here
            total = self.tied[0].grad + self.tied[1].grad
            for p in self.tied:
                p.grad.copy_(total)
        elif self.tied:
            grad = self.tied[0].grad
            with self.record("comm", None, "tied"):
                wait_for(dist.all_reduce(grad, group=self.tied_group, async_op=True), self.timeout,
                         f"{self.who}: tied-embedding gradient sum")
            self.bytes_tied = grad.numel() * grad.element_size()
        if self.average is not None:
            with self.record("comm", None, "dp"):
                try:
                    self.average.synchronize()
                except RuntimeError as error:
                    raise RuntimeError(f"{self.who}: gradient all-reduce over the stage's dp group: {error}") from error
