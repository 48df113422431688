"""Which gradients travel together: DDP's bucketing rule, the one every engine of the course uses.

One all-reduce per parameter pays one latency per tensor (a GPT-2 has ~150); one message for the
whole model can only start once backward has finished. PyTorch's ``DistributedDataParallel`` packs
gradients into *buckets* of about ``bucket_cap_mb`` (25 MB by default), filled in reverse order of
the parameters, roughly the order in which backward produces their gradients, so the last layers'
bucket is on the wire while backward still computes the first layers' gradients (chapter 02).

:func:`make_buckets` is that rule: consecutive parameters up to a cap in bytes, a parameter larger
than the cap alone, and never two dtypes or two devices in one bucket (a bucket is one flat buffer).
Chapter 02's :class:`~parallel_lib.data_parallel.allreduce.BucketedAllReduce` and chapter 06's
ZeRO stages 0-2 (:func:`~parallel_lib.sharding.grouping.flat_groups`) bucket with it, and so does
the formula that predicts their messages (:func:`~parallel_lib.training.traffic.dp_groups`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from parallel_lib.common.checks import check_int

__all__ = ["make_buckets"]


def make_buckets(params: Sequence[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive parameters grouped into buckets of at most ``cap_bytes`` each.

    The order is kept: pass the parameters in the order their gradients will be ready (for DDP's
    overlap, the reverse of ``model.parameters()``). A new bucket starts when the next parameter
    would take the bucket over the cap, or has another dtype or device than the bucket; a parameter
    larger than the cap gets a bucket of its own.

    Args:
        params: the parameters (or empty stand-ins of their shape, e.g. on the meta device).
        cap_bytes: the largest bucket in bytes (DDP's ``bucket_cap_mb · 2**20``).

    Returns:
        The buckets, lists of the given tensors, in order.

    Raises:
        ValueError: ``cap_bytes`` is not an int >= 0.
    """
    check_int("cap_bytes", cap_bytes, minimum=0)
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        same_kind = buckets and (buckets[-1][0].dtype, buckets[-1][0].device) == (p.dtype, p.device)
        if same_kind and size + nbytes <= cap_bytes:
            buckets[-1].append(p)
            size += nbytes
        else:
            buckets.append([p])
            size = nbytes
    return buckets
