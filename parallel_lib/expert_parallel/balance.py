"""Load balance: the auxiliary loss that spreads tokens over experts, and the counts that measure it.

Left alone, a router learns to favour the few experts that happened to be good early; they
get more tokens, improve, and get more still, while the others starve. With expert
parallelism that is also a straggler: every all-to-all waits for the rank whose experts got
the most tokens. Switch Transformer (Fedus et al. 2021, eq. 4, after GShard's auxiliary
loss) adds to the training loss ``α`` times::

    loss = E · Σ_i f_i · P_i

where ``f_i`` is the fraction of the token choices that went to expert ``i`` (a count: no
gradient) and ``P_i`` the mean router probability of expert ``i`` (differentiable). Both are
``1/E`` under perfect balance, where the loss is 1; it grows as tokens pile onto experts
that also hold the probability, and its gradient lowers the probability of the busiest
experts. Choices are counted before capacity drops any (what the router asked for).

The counts (:func:`tokens_per_expert`, :func:`tokens_per_rank`, :func:`imbalance`) are what
chapter 12 plots: tokens per expert and per rank over training, and the busiest rank against
the mean.
"""

from __future__ import annotations

import torch

from parallel_lib.common.checks import positive_int

__all__ = ["load_balancing_loss", "tokens_per_expert", "tokens_per_rank", "imbalance"]


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's auxiliary loss ``E · Σ_i f_i · P_i`` of one group of tokens (a 0-d fp32 tensor).

    Args:
        probs: (T, E) router probabilities (:class:`~.router.Routing`'s ``probs``).
        experts: (T, k) chosen experts.

    Raises:
        ValueError: shapes that do not match, or no tokens.
    """
    if probs.dim() != 2 or experts.dim() != 2 or probs.shape[0] != experts.shape[0]:
        raise ValueError(f"probs must be (T, E) and experts (T, k) with the same T, got {tuple(probs.shape)} and "
                         f"{tuple(experts.shape)}")
    if probs.shape[0] == 0:
        raise ValueError("load_balancing_loss needs at least one token, got probs of shape (0, E)")
    n_experts = probs.shape[1]
    f = tokens_per_expert(experts, n_experts).to(probs.dtype) / experts.numel()  # (E,) no gradient
    p = probs.mean(dim=0)                                                        # (E,)
    return n_experts * (f * p).sum()


def tokens_per_expert(experts: torch.Tensor, n_experts: int, kept: torch.Tensor | None = None) -> torch.Tensor:
    """How many choices went to each expert, (E,) int64; only the kept ones when ``kept`` (T, k) is given."""
    positive_int("n_experts", n_experts)
    chosen = experts if kept is None else experts[kept]
    return torch.bincount(chosen.reshape(-1), minlength=n_experts)


def tokens_per_rank(counts: torch.Tensor, ep: int) -> torch.Tensor:
    """Tokens each expert-parallel rank computes: (ep,), rank ``q`` holding experts ``q·E/ep .. (q+1)·E/ep - 1``.

    Raises:
        ValueError: ``ep`` does not divide the number of experts.
    """
    positive_int("ep", ep)
    if counts.numel() % ep:
        raise ValueError(f"ep={ep} must divide the number of experts ({counts.numel()}): each rank holds E/ep")
    return counts.reshape(ep, -1).sum(dim=1)


def imbalance(counts: torch.Tensor) -> float:
    """Busiest over mean: 1.0 is perfect balance; every all-to-all waits for the busiest (1 when all are 0)."""
    counts = counts.float()
    mean = float(counts.mean())
    return float(counts.max()) / mean if mean > 0 else 1.0
