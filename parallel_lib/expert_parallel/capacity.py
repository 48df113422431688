"""Expert capacity: at most ``C`` tokens per expert, the rest dropped (GShard, Switch Transformer).

On a GPU every expert's batch must have a size known before the router has spoken, so each
expert gets a fixed number of slots, its capacity::

    C = ceil(capacity_factor · T · k / E)        (T tokens, k choices each, E experts)

A factor of 1 gives every expert exactly its fair share; 1.25 leaves a quarter as slack.
An expert chosen more than ``C`` times keeps its first ``C`` choices, in this order: every
token's first choice (tokens in order), then every token's second choice, and so on (GShard's
priority of the top-1 choice). A dropped choice contributes nothing to the layer's output;
the block's residual connection still carries the token past the layer. ``capacity_factor``
None means no limit (nothing dropped), which is how the one-process reference and inference run.

Capacity is counted per *group* of tokens (GShard's groups): with expert parallelism each rank
routes its own tokens and fills its own slots, so the one-process reference that proves it
exact splits its tokens into the same groups (:class:`~.moe.MoE`'s ``token_groups``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from parallel_lib.common.checks import check_int, check_number, positive_int

__all__ = ["expert_capacity", "keep_within_capacity"]


def expert_capacity(tokens: int, n_experts: int, top_k: int, capacity_factor: Optional[float]) -> Optional[int]:
    """``ceil(capacity_factor · tokens · top_k / n_experts)``, or None (no limit) when the factor is None.

    Raises:
        ValueError: a count below 1 (``tokens`` may be 0), or a factor that is not a number > 0.
    """
    check_int("tokens", tokens, 0)
    positive_int("n_experts", n_experts)
    positive_int("top_k", top_k)
    if capacity_factor is None:
        return None
    factor = check_number("capacity_factor", capacity_factor, 0.0, strict=True,
                          hint="use e.g. 1.0 or 1.25, or None for no limit")
    return math.ceil(factor * tokens * top_k / n_experts - 1e-9)  # 1e-9: 1.25·8·2/4 is 5, not 5.000000001


def keep_within_capacity(experts: torch.Tensor, n_experts: int, capacity: Optional[int]) -> torch.Tensor:
    """Which choices an expert keeps: (T, k) bool, True where the choice is among its expert's first ``capacity``.

    Args:
        experts: (T, k) chosen experts (the router's ``experts``).
        n_experts: E.
        capacity: slots per expert (:func:`expert_capacity`); None keeps every choice.

    Raises:
        ValueError: ``experts`` is not 2-D.
    """
    if experts.dim() != 2:
        raise ValueError(f"experts must be (tokens, k), got shape {tuple(experts.shape)}")
    if capacity is None:
        return torch.ones_like(experts, dtype=torch.bool)
    order = experts.t().reshape(-1)                                           # (k·T,) first choices first
    one_hot = torch.nn.functional.one_hot(order, n_experts)                   # (k·T, E)
    position = (one_hot.cumsum(0) - 1).gather(1, order[:, None]).squeeze(1)   # place in its expert's queue
    return (position < capacity).reshape(experts.shape[1], -1).t()           # (T, k)
