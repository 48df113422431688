"""Which slice of a dense weight each rank keeps: pure functions, no communication.

The one that matters is :func:`qkv_rows`. Hugging Face's GPT-2 computes queries, keys
and values with one ``Conv1D`` called ``c_attn``: its weight is (in, 3·h), the
*transpose* of ``nn.Linear``'s (out, in), and its 3·h output features are
``[q (h) | k (h) | v (h)]``. Cutting those 3·h features into ``t`` contiguous pieces
(:func:`naive_qkv_rows`, what a column-parallel split of "a linear layer" does) gives
rank 0 all the queries and half the keys for t = 2: every rank then runs attention with
the wrong tensors. A rank must instead keep *its heads* of q, of k and of v.
"""

from __future__ import annotations

import torch

from parallel_lib.common.checks import positive_int

__all__ = ["check_divisible", "shard", "qkv_rows", "naive_qkv_rows"]


def check_divisible(name: str, value: int, tp: int, hint: str = "") -> int:
    """``value // tp``, or a ValueError naming ``name`` when ``tp`` does not divide it."""
    positive_int("tp", tp)
    if value % tp:
        raise ValueError(f"{name}={value} is not divisible by the tensor-parallel size tp={tp}"
                         f"{'; ' + hint if hint else ''}")
    return value // tp


def shard(tensor: torch.Tensor, dim: int, rank: int, tp: int, name: str = "dimension") -> torch.Tensor:
    """Rank ``rank``'s contiguous slice of ``tensor`` along ``dim`` (a copy, detached).

    Raises:
        ValueError: ``tp`` does not divide the size of ``dim``.
    """
    size = check_divisible(name, tensor.shape[dim], tp)
    return tensor.detach().narrow(dim, rank * size, size).clone()


def qkv_rows(n_embd: int, n_head: int, rank: int, tp: int) -> torch.Tensor:
    """Indices of the fused q|k|v output features that rank ``rank`` keeps: its heads of each.

    Returns ``[q of my heads, k of my heads, v of my heads]``, so the local output still
    reads as three equal parts (``chunk(3, -1)``), each holding ``n_head / tp`` heads.

    Raises:
        ValueError: ``n_head`` not divisible by ``tp``.
    """
    check_divisible("n_head", n_head, tp, hint="choose a tensor-parallel size that divides the number of heads")
    local = n_embd // tp  # my heads' features in each of q, k, v
    return torch.cat([torch.arange(part * n_embd + rank * local, part * n_embd + (rank + 1) * local)
                      for part in range(3)])


def naive_qkv_rows(n_embd: int, rank: int, tp: int) -> torch.Tensor:
    """The classic mistake: a contiguous 1/tp of the fused 3·h features, ignoring q, k, v."""
    local = check_divisible("3 * n_embd", 3 * n_embd, tp)
    return torch.arange(rank * local, (rank + 1) * local)

