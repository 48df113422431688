"""Bytes on the wire of expert parallelism: what the all-to-alls of one mixture layer move.

The formula (:func:`ep_traffic`, :class:`EPTraffic`) lives with the course's other cost formulas in
:mod:`parallel_lib.cost.moe`: per layer and rank, the counts (``E · 8`` bytes), then the dispatch
and the combine of ``T · k`` rows of ``h`` elements forward, and both again reversed backward.

Those are the messages (the counter's ``nbytes``). What leaves the rank is less: the rows
whose expert lives on this rank stay. With balanced routing a share ``1/ep`` stays, so each
all-to-all puts ``(ep-1)/ep`` of its message on the wire. :func:`rows_leaving` counts the
exact number from a routing record (capacity drops and imbalance included). The collective
counter (:mod:`parallel_lib.runtime.collectives`) charges an all-to-all ``(ep-1)/ep`` of its
message whatever its splits: exact for balanced routing, an estimate otherwise, where
``rows_leaving · h · b`` is what the dispatch really sends.
"""

from __future__ import annotations

import torch

from parallel_lib.common.checks import check_int, positive_int
from parallel_lib.cost.moe import COUNT_BYTES, EPTraffic, ep_traffic

__all__ = ["EPTraffic", "ep_traffic", "rows_leaving", "COUNT_BYTES"]


def rows_leaving(experts: torch.Tensor, kept: torch.Tensor, n_experts: int, ep: int, ep_rank: int) -> int:
    """Kept choices of this rank whose expert lives on another rank: the rows its dispatch sends away.

    Raises:
        ValueError: ``ep`` does not divide ``n_experts``, or ``ep_rank`` outside ``0..ep-1``.
    """
    positive_int("ep", ep)
    check_int("ep_rank", ep_rank, 0, ep - 1)
    if n_experts % ep:
        raise ValueError(f"ep={ep} must divide n_experts={n_experts}")
    owner = experts[kept] // (n_experts // ep)
    return int((owner != ep_rank).sum())
