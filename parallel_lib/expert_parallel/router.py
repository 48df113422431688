"""The router: which experts each token goes to, and with what weight (top-k of a softmax).

A mixture of experts replaces one feed-forward network by ``E`` of them and lets each
token use only ``k``. A linear layer without bias scores every expert for every token;
the scores become probabilities by a softmax (in fp32, whatever the activations' dtype),
and the ``k`` most probable experts are the token's choices. Their probabilities are the
weights of the experts' outputs in the sum (Switch Transformer, Fedus et al. 2021, eq. 1-2;
GShard, Lepikhin et al. 2020). Mixtral and DeepSeek-V3 rescale the ``k`` weights to sum to 1
(``normalize=True``); Switch (``k = 1``) keeps the raw probability, so the router's weights
receive a gradient through the expert's output.

Ties are broken towards the lower expert index (``torch.topk`` on CPU and CUDA), so every
process that routes the same tokens makes the same choices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from parallel_lib.common.checks import check_int, positive_int

__all__ = ["Routing", "Router", "top_k_route"]


@dataclass
class Routing:
    """A router's decision for ``T`` tokens."""

    probs: torch.Tensor    # (T, E) fp32 softmax over experts (the balancing loss reads it)
    experts: torch.Tensor  # (T, k) int64 chosen experts, most probable first
    weights: torch.Tensor  # (T, k) fp32 their weights in the sum


def top_k_route(logits: torch.Tensor, top_k: int, normalize: bool = False) -> Routing:
    """The top-``k`` experts of each token from the router's scores ``logits`` (T, E).

    Args:
        logits: (T, E) scores, one row per token.
        top_k: experts per token, 1..E.
        normalize: rescale each token's ``k`` weights to sum to 1 (Mixtral, DeepSeek-V3).

    Returns:
        :class:`Routing` (probabilities, choices, weights).

    Raises:
        ValueError: ``logits`` is not 2-D, or ``top_k`` is outside 1..E.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be (tokens, experts), got shape {tuple(logits.shape)}")
    check_int("top_k", top_k, 1, logits.shape[1], hint="a token cannot choose more experts than there are")
    probs = torch.softmax(logits.float(), dim=-1)  # (T, E)
    weights, experts = probs.topk(top_k, dim=-1)   # (T, k) each, most probable first
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(probs, experts, weights)


class Router(nn.Module):
    """A bias-free linear layer ``hidden -> n_experts`` followed by :func:`top_k_route`.

    Args:
        hidden: the token width.
        n_experts: how many experts to choose from.
        top_k: experts per token.
        normalize: see :func:`top_k_route`.

    Raises:
        ValueError: a count below 1, or ``top_k > n_experts``.
    """

    def __init__(self, hidden: int, n_experts: int, top_k: int = 1, normalize: bool = False) -> None:
        super().__init__()
        positive_int("hidden", hidden)
        positive_int("n_experts", n_experts)
        check_int("top_k", top_k, 1, n_experts, hint="a token cannot choose more experts than there are")
        self.top_k, self.normalize = top_k, bool(normalize)
        self.gate = nn.Linear(hidden, n_experts, bias=False)

    def forward(self, x: torch.Tensor) -> Routing:
        """Route ``x`` (T, hidden)."""
        return top_k_route(self.gate(x), self.top_k, self.normalize)
