"""Bytes on the wire of expert parallelism: what the all-to-alls of one mixture layer move.

Per layer and rank, with ``T`` tokens on the rank, ``k`` choices each, width ``h`` and
``b`` bytes per element, nothing dropped::

    forward:  the counts  (E int64 values)                    E · 8 bytes
              dispatch    T · k rows of h                     T · k · h · b bytes
              combine     the same rows back                  T · k · h · b bytes
    backward: the two row all-to-alls again, reversed         2 · T · k · h · b bytes

Those are the messages (the counter's ``nbytes``). What leaves the rank is less: the rows
whose expert lives on this rank stay. With balanced routing a share ``1/ep`` stays, so each
all-to-all puts ``(ep-1)/ep`` of its message on the wire. :func:`rows_leaving` counts the
exact number from a routing record (capacity drops and imbalance included). The collective
counter (:mod:`parallel_lib.runtime.collectives`) charges an all-to-all ``(ep-1)/ep`` of its
message whatever its splits: exact for balanced routing, an estimate otherwise, where
``rows_leaving · h · b`` is what the dispatch really sends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel_lib.common.checks import check_int, positive_int

__all__ = ["EPTraffic", "ep_traffic", "rows_leaving"]

COUNT_BYTES = 8  # the counts travel as int64


@dataclass(frozen=True)
class EPTraffic:
    """One mixture layer's all-to-alls on one rank, forward and backward (balanced routing)."""

    calls_forward: int    # counts, dispatch, combine
    calls_backward: int   # combine and dispatch, reversed
    row_bytes: int        # one all-to-all of rows: T · k · h · b
    count_bytes: int      # the all-to-all of counts: E · 8
    ep: int

    @property
    def message_bytes(self) -> int:
        """Every message of forward and backward: ``4 · T·k·h·b + E·8``."""
        return 4 * self.row_bytes + self.count_bytes

    @property
    def wire_bytes(self) -> float:
        """What leaves the rank: ``(ep-1)/ep`` of every message."""
        return self.message_bytes * (self.ep - 1) / self.ep


def ep_traffic(tokens: int, top_k: int, hidden: int, n_experts: int, ep: int, dtype_bytes: int = 4) -> EPTraffic:
    """The all-to-all traffic of one mixture layer on one rank (see the module docstring).

    Args:
        tokens: tokens on this rank (batch · sequence / ep).
        top_k: choices per token.
        hidden: the token width.
        n_experts: E.
        ep: ranks of the expert-parallel group.
        dtype_bytes: bytes per element of the activations (4 fp32, 2 bf16).

    Raises:
        ValueError: a count below 1 (``tokens`` may be 0).
    """
    check_int("tokens", tokens, 0)
    for name, value in (("top_k", top_k), ("hidden", hidden), ("n_experts", n_experts), ("ep", ep),
                        ("dtype_bytes", dtype_bytes)):
        positive_int(name, value)
    return EPTraffic(3, 2, tokens * top_k * hidden * dtype_bytes, n_experts * COUNT_BYTES, ep)


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
