"""The dispatch of one forward as data: which rows a rank sends to which rank, read off its routing record.

:class:`~.expert_parallel_moe.ExpertParallelMoE` computes this inline, step [2] of its forward;
here it is a pure function of a :class:`~.moe.RoutingRecord`'s ``experts`` and ``kept``, so that
chapter 12's widget can replay the all-to-all a run made, rank by rank, and the exercise on the
dispatch has a reference::

    kept choices (t, j), token order          [(0,0) e2] [(1,0) e0] [(1,1) e3] [(2,0) e0] ...
    sorted by expert (stable)                 [(1,0) e0] [(2,0) e0] [(0,0) e2] [(1,1) e3] ...
    counts per expert (E,)                     e0: 2       e1: 0      e2: 1      e3: 1
    send: counts summed per rank (ep,)         rank 0 (e0, e1): 2        rank 1 (e2, e3): 2

Rank ``q`` holds experts ``q·E/ep .. (q+1)·E/ep - 1``. What rank ``q`` receives is every rank's
counts for its experts (the all-to-all of counts), row ``s`` from rank ``s``: :func:`receive_counts`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from parallel_lib.common.checks import check_int, positive_int

__all__ = ["DispatchPlan", "dispatch_plan", "receive_counts"]


@dataclass(frozen=True)
class DispatchPlan:
    """One rank's dispatch: row ``i`` of the message is token ``token[i]``'s choice ``slot[i]``."""

    token: torch.Tensor   # (N,) int64 token of each row, rows sorted by expert
    slot: torch.Tensor    # (N,) int64 which of the token's k choices
    expert: torch.Tensor  # (N,) int64 the row's expert (non-decreasing)
    counts: torch.Tensor  # (E,) int64 rows for each expert
    send: list[int]       # (ep,) rows for each rank: counts summed over the rank's experts


def dispatch_plan(experts: torch.Tensor, kept: torch.Tensor, n_experts: int, ep: int) -> DispatchPlan:
    """The rows one rank sends, from its router's choices (as :class:`~.expert_parallel_moe.ExpertParallelMoE`).

    Args:
        experts: (T, k) chosen experts of this rank's tokens.
        kept: (T, k) bool, False where capacity dropped the choice (dropped choices are not sent).
        n_experts: E.
        ep: ranks of the expert-parallel group (divides E).

    Raises:
        ValueError: shapes that differ or are not 2-D, or ``ep`` not dividing ``n_experts``.
    """
    positive_int("n_experts", n_experts)
    positive_int("ep", ep)
    if n_experts % ep:
        raise ValueError(f"ep={ep} must divide n_experts={n_experts}: each rank holds n_experts/ep experts")
    if experts.dim() != 2 or kept.shape != experts.shape:
        raise ValueError(f"experts and kept must both be (tokens, k), got {tuple(experts.shape)} and "
                         f"{tuple(kept.shape)}")
    token, slot = torch.nonzero(kept, as_tuple=True)           # kept choices, token order
    order = torch.argsort(experts[token, slot], stable=True)   # by expert, token order within one
    token, slot = token[order], slot[order]
    expert = experts[token, slot]
    counts = torch.bincount(expert, minlength=n_experts)
    return DispatchPlan(token, slot, expert, counts, counts.reshape(ep, -1).sum(1).tolist())


def receive_counts(counts: Sequence[torch.Tensor], ep_rank: int) -> torch.Tensor:
    """What rank ``ep_rank`` learns in the all-to-all of counts: (ep, E/ep), row ``s`` from rank ``s``.

    Args:
        counts: every rank's (E,) counts (:attr:`DispatchPlan.counts`), in rank order.
        ep_rank: the receiving rank.

    Raises:
        ValueError: ``ep_rank`` outside the ranks, or counts whose length the ranks do not divide.
    """
    ep = len(counts)
    check_int("ep_rank", ep_rank, 0, ep - 1)
    stacked = torch.stack(list(counts))                        # (ep, E)
    if stacked.shape[1] % ep:
        raise ValueError(f"{ep} ranks must divide the {stacked.shape[1]} experts of the counts")
    local = stacked.shape[1] // ep
    return stacked[:, ep_rank * local:(ep_rank + 1) * local]
