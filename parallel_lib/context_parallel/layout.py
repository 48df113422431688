"""Which tokens a context-parallel rank holds: the contiguous split, and the zig-zag split that balances causal work.

Cut the sequence into ``2·cp`` equal chunks. The obvious split gives rank i the chunks
``2i`` and ``2i+1``: one contiguous piece. Under a causal mask a query attends to the keys
before it, so a query near the end does ~s units of work and one near the start ~1: the
last rank's queries see almost the whole sequence, the first rank's only their own piece.
Counting score entries, rank i's share is ``(i + 1/2)·(s/cp)²``: the last rank does
``(2·cp − 1)`` times the first rank's work, and every ring step waits for it.

The zig-zag split (Megatron-LM's and Llama 3's "load-balanced" CP) gives rank i the chunks
``i`` and ``2·cp − 1 − i``: one from the cheap start and its mirror from the expensive end,
so every rank's two chunks add to the same work, ``(2·cp − 1)·c² + c(c + 1)`` entries for
chunks of ``c`` tokens::

    cp = 2, chunks 0 1 2 3:    contiguous: rank 0 [0 1]  rank 1 [2 3]   work 1 : 3 (about)
                               zig-zag:    rank 0 [0 3]  rank 1 [1 2]   work 1 : 1

A rank's tokens are then not one interval, so attention takes their *positions*
(:func:`shard_positions`) and masks by position (:mod:`.tiled`); the model's position
embeddings take the same positions.
"""

from __future__ import annotations

from typing import Sequence

import torch

from parallel_lib.common.checks import check_choice, check_int, positive_int

__all__ = ["LAYOUTS", "chunk_ids", "shard_positions", "shard_sequence", "gather_sequence"]

LAYOUTS = ("contiguous", "zigzag")


def chunk_ids(cp: int, index: int, layout: str = "contiguous") -> tuple[int, int]:
    """The two chunks (of ``2·cp``) that context-parallel rank ``index`` holds, in sequence order.

    Raises:
        ValueError: ``cp`` not a positive int, ``index`` not in ``0..cp-1``, an unknown ``layout``.
    """
    cp = positive_int("cp", cp)
    index = check_int("index", index, 0, cp - 1)
    check_choice("layout", layout, LAYOUTS)
    if layout == "contiguous":
        return 2 * index, 2 * index + 1
    return index, 2 * cp - 1 - index


def _chunk(seq_len: int, cp: int) -> int:
    seq_len = positive_int("seq_len", seq_len)
    if seq_len % (2 * cp):
        raise ValueError(f"seq_len must be divisible by 2·cp = {2 * cp} (two chunks per rank), got "
                         f"seq_len={seq_len}; pad the sequence to a multiple of {2 * cp}")
    return seq_len // (2 * cp)


def shard_positions(seq_len: int, cp: int, index: int, layout: str = "contiguous",
                    device: torch.device | str | None = None) -> torch.Tensor:
    """The positions (seq_len / cp of them, increasing) of the tokens rank ``index`` holds.

    Raises:
        ValueError: bad ``cp``, ``index`` or ``layout``; ``seq_len`` not divisible by ``2·cp``.
    """
    first, second = chunk_ids(cp, index, layout)
    c = _chunk(seq_len, cp)
    return torch.cat([torch.arange(first * c, (first + 1) * c, device=device),
                      torch.arange(second * c, (second + 1) * c, device=device)])


def shard_sequence(x: torch.Tensor, cp: int, index: int, layout: str = "contiguous", dim: int = 1) -> torch.Tensor:
    """Rank ``index``'s tokens of ``x`` along ``dim`` (ids (b, s): ``dim=1``; heads (b, n, s, d): ``dim=2``).

    Raises:
        TypeError: ``x`` is not a tensor.
        ValueError: as :func:`shard_positions`, for the length of ``x`` along ``dim``.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a tensor, got {type(x).__name__}")
    return x.index_select(dim, shard_positions(x.shape[dim], cp, index, layout, x.device))


def gather_sequence(shards: Sequence[torch.Tensor], layout: str = "contiguous", dim: int = 1) -> torch.Tensor:
    """The whole sequence back from every rank's shard (in rank order): the inverse of :func:`shard_sequence`.

    Raises:
        ValueError: no shards, or shards of different lengths along ``dim``.
    """
    if not shards:
        raise ValueError("shards must hold one tensor per context-parallel rank, got none")
    lengths = {t.shape[dim] for t in shards}
    if len(lengths) != 1:
        raise ValueError(f"every shard must hold as many tokens along dim={dim}, got lengths "
                         f"{[t.shape[dim] for t in shards]}")
    cp, local = len(shards), lengths.pop()
    whole = torch.cat(list(shards), dim=dim)
    positions = torch.cat([shard_positions(local * cp, cp, i, layout, whole.device) for i in range(cp)])
    return whole.index_select(dim, torch.argsort(positions))
