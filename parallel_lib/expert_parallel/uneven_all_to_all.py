"""The all-to-all with uneven splits, forward and backward, with a timeout that names the rank.

Expert parallelism moves each token to the rank that holds its expert and back. Every rank
sends a different number of rows to every other rank, so before the tokens move, the ranks
tell each other how many to expect: an all-to-all of the per-expert counts
(:func:`exchange_counts`), from which each rank computes its receive sizes. Then
``all_to_all_single`` moves the rows with those uneven split sizes.

The backward of an all-to-all is the all-to-all with the splits swapped: a row that went from
rank ``a`` to rank ``b`` in the forward carries its gradient from ``b`` back to ``a``
(:class:`AllToAll`). A layer that dispatches and combines thus issues two all-to-alls of
rows forward and two backward.

Every wait has a limit: a peer that died or never arrived becomes a ``TimeoutError`` that
names this rank and the exchange, never a hang.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from parallel_lib.common.checks import positive_number
from parallel_lib.runtime.waiting import wait_for

__all__ = ["exchange_counts", "all_to_all", "AllToAll"]


def _wait(work: Any, timeout: float, what: str, group: Any) -> None:
    """Wait for ``work`` (:func:`~parallel_lib.runtime.waiting.wait_for`); a failure names this rank and the exchange."""
    wait_for(work, timeout, f"rank {dist.get_rank()} (rank {dist.get_rank(group)} of its ep group): {what}")


def exchange_counts(counts: torch.Tensor, group: Any, timeout: float = 60.0) -> torch.Tensor:
    """Tell every rank how many rows this one sends to each of its experts; learn the same from every rank.

    Args:
        counts: (E,) int64 rows for each expert, experts ``q·E/ep ..`` living on rank ``q`` of ``group``.
        group: the expert-parallel process group (``mesh.group("ep")``).
        timeout: seconds to wait.

    Returns:
        (ep, E/ep) int64: row ``s`` holds what rank ``s`` sends to each of this rank's experts.

    Raises:
        ValueError: the group's size does not divide ``counts``.
        TimeoutError: the exchange did not finish in time (names this rank).
        RuntimeError: a peer failed during the exchange (names this rank).
    """
    positive_number("timeout", timeout)
    ep = dist.get_world_size(group)
    if counts.dim() != 1 or counts.numel() % ep:
        raise ValueError(f"counts must be (E,) with E divisible by the ep group's {ep} ranks, got shape "
                         f"{tuple(counts.shape)}")
    received = torch.empty_like(counts)
    _wait(dist.all_to_all_single(received, counts, group=group, async_op=True), timeout, "the all-to-all of counts",
          group)
    return received.reshape(ep, -1)


def _exchange(x: torch.Tensor, send: list[int], receive: list[int], group: Any, timeout: float) -> torch.Tensor:
    out = x.new_empty((sum(receive),) + tuple(x.shape[1:]))
    work = dist.all_to_all_single(out, x.contiguous(), receive, send, group=group, async_op=True)
    _wait(work, timeout, f"the all-to-all of rows (sending {send}, receiving {receive})", group)
    return out


class AllToAll(torch.autograd.Function):
    """Rows ``x[sum(send[:q]) : sum(send[:q+1])]`` go to rank ``q``; the backward sends gradients back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], receive: list[int], group: Any,  # type: ignore[override]
                timeout: float) -> torch.Tensor:
        ctx.send, ctx.receive, ctx.group, ctx.timeout = send, receive, group, timeout
        return _exchange(x, send, receive, group, timeout)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        return _exchange(grad, ctx.receive, ctx.send, ctx.group, ctx.timeout), None, None, None, None


def all_to_all(x: torch.Tensor, send: Sequence[int], receive: Sequence[int], group: Any,
               timeout: float = 60.0) -> torch.Tensor:
    """Exchange rows of ``x`` (N, ...) over ``group`` with uneven split sizes, differentiably.

    Args:
        x: rows to send, grouped by destination rank.
        send: rows for each rank of ``group`` (sums to ``N``).
        receive: rows from each rank (from :func:`exchange_counts`).
        group: the process group.
        timeout: seconds each exchange (forward and backward) may wait.

    Returns:
        (sum(receive), ...) rows, grouped by source rank.

    Raises:
        ValueError: split lists of the wrong length, or ``send`` not summing to ``x``'s rows.
        TimeoutError: see :func:`exchange_counts`.
    """
    positive_number("timeout", timeout)
    ep = dist.get_world_size(group)
    send, receive = [int(n) for n in send], [int(n) for n in receive]
    if len(send) != ep or len(receive) != ep:
        raise ValueError(f"send and receive must hold one size per rank of the group ({ep}), got {send} and {receive}")
    if sum(send) != x.shape[0]:
        raise ValueError(f"send={send} sums to {sum(send)} rows but x has {x.shape[0]}")
    return AllToAll.apply(x, send, receive, group, timeout)
