"""The one place that knows which torch names the reduce-scatter and all-gather of one tensor go by.

torch 2.13 renamed ``dist.reduce_scatter_tensor`` and ``dist.all_gather_into_tensor`` to
``dist.reduce_scatter_single`` and ``dist.all_gather_single`` (same arguments) and warns
(``FutureWarning``) at every call of the old names, so a benchmark's output drowns in
warnings. The course's torch floor (2.4) only has the old names. Every caller in the
library goes through the two functions here, which pick the new name where torch has it
and the old one otherwise. The name is looked up at each call, so the collective counter
and the guard, which stand in for ``torch.distributed``'s functions, see the call.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = ["reduce_scatter_single", "all_gather_single", "collective_name"]

# the name torch >= 2.13 uses -> the name on the floor torch (2.4)
_RENAMED = {"reduce_scatter_single": "reduce_scatter_tensor", "all_gather_single": "all_gather_into_tensor"}


def collective_name(new: str) -> str:
    """``new`` if this torch has it, else the old name it replaces (see ``_RENAMED``)."""
    return new if hasattr(dist, new) else _RENAMED[new]


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, op: Any = dist.ReduceOp.SUM,
                          group: Optional[Any] = None, async_op: bool = False) -> Any:
    """Reduce ``input`` (``N`` chunks along dim 0) over the group; this rank's chunk into ``output``.

    ``dist.reduce_scatter_single`` where it exists, else ``dist.reduce_scatter_tensor``.
    Returns the work handle when ``async_op``, else None.
    """
    return getattr(dist, collective_name("reduce_scatter_single"))(output, input, op=op, group=group,
                                                                     async_op=async_op)


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: Optional[Any] = None,
                      async_op: bool = False) -> Any:
    """Every rank's ``input`` into ``output``, concatenated along dim 0 in rank order.

    ``dist.all_gather_single`` where it exists, else ``dist.all_gather_into_tensor``.
    Returns the work handle when ``async_op``, else None.
    """
    return getattr(dist, collective_name("all_gather_single"))(output, input, group=group, async_op=async_op)
