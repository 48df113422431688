"""The paged KV cache: one preallocated pool of fixed-size blocks per layer, read through block tables.

Chapter 09's cache gives every request a row of ``max_len`` slots for the whole of its life. Here
each layer's keys (and values) are one tensor of ``num_blocks · block_size`` slots::

    pool[layer]   (num_blocks · block_size, heads, head_dim)       slot = block · block_size + offset

and a sequence's token ``t`` lives at ``table[t // block_size] · block_size + t % block_size``, its
block table coming from the :class:`~parallel_lib.serving.block_manager.BlockManager`. Blocks of one
sequence need not be adjacent, nor in order: that is what lets a request take memory as it grows,
give it back when it ends, and share a prompt's blocks with another request (Kwon et al. 2023,
"Efficient Memory Management for Large Language Model Serving with PagedAttention").

**Attention through the table.** The one GPT-2's attention takes any ``KVStore``:
``update(layer, k, v)`` stores the step's new keys and values and returns everything the
queries may see. A :class:`PagedStep` writes each new token at its slot, then *gathers* each row's
slots in token order (``pool[read_slots]``) into the dense ``(b, heads, T, d)`` keys and values the
attention multiplies with; a mask hides the positions past a row's own length. vLLM's kernel reads
the blocks in place instead of gathering them; the gather costs a copy and keeps the model's
attention unchanged.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch

from parallel_lib.common.checks import positive_int

__all__ = ["PagedKVCache", "PagedStep", "slots_of"]


def slots_of(table: Sequence[int], start: int, stop: int, block_size: int) -> list[int]:
    """The pool slots of tokens ``start .. stop-1`` of a sequence with block table ``table``.

    Raises:
        ValueError: the table has too few blocks for ``stop`` tokens.
    """
    if stop > len(table) * block_size:
        raise ValueError(f"a block table of {len(table)} blocks of {block_size} holds {len(table) * block_size} "
                         f"tokens, not {stop}; allocate the blocks first")
    return [table[t // block_size] * block_size + t % block_size for t in range(start, stop)]


class PagedKVCache:
    """Keys and values of ``layers`` in ``num_blocks`` blocks of ``block_size`` slots, preallocated.

    Args:
        layers: the global indices of the layers it serves.
        num_blocks, block_size: the pool's size.
        heads, head_dim: of the attention it serves.
        dtype, device: of the pool.

    Raises:
        ValueError: a count below 1, or no layers.
    """

    def __init__(self, layers: Iterable[int], num_blocks: int, block_size: int, heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None) -> None:
        self.layers = list(layers)
        if not self.layers:
            raise ValueError("layers must name at least one layer, got layers=[]")
        self.num_blocks = positive_int("num_blocks", num_blocks)
        self.block_size = positive_int("block_size", block_size)
        self.heads, self.head_dim = positive_int("heads", heads), positive_int("head_dim", head_dim)
        shape = (num_blocks * block_size, heads, head_dim)
        self.k = {i: torch.zeros(shape, dtype=dtype, device=device) for i in self.layers}
        self.v = {i: torch.zeros(shape, dtype=dtype, device=device) for i in self.layers}

    def at(self, write: torch.Tensor, valid: torch.Tensor, read: torch.Tensor) -> PagedStep:
        """This pool as the model's KV store for one pass (see :class:`PagedStep`)."""
        return PagedStep(self, write, valid, read)

    def nbytes(self) -> int:
        """Bytes of the pool's tensors (storage census).

        Equals ``2 · layers · num_blocks · block_size · heads · head_dim · itemsize``.
        """
        return sum(t.untyped_storage().nbytes() for i in self.layers for t in (self.k[i], self.v[i]))

    def bytes_per_block(self) -> int:
        """Bytes one block costs over every layer, keys and values."""
        return self.nbytes() // self.num_blocks


class PagedStep:
    """One forward pass's view of a :class:`PagedKVCache` (the model's ``KVStore``).

    Args:
        cache: the pool.
        write: (b, s) the slot of each new token (anything where ``valid`` is False: padding).
        valid: (b, s) True on real new tokens.
        read: (b, T) the slots of each row's tokens ``0 .. T-1`` in order (padding past a row's length:
            any slot, the mask hides it).
    """

    def __init__(self, cache: PagedKVCache, write: torch.Tensor, valid: torch.Tensor, read: torch.Tensor) -> None:
        self.cache, self.write, self.valid, self.read = cache, write[valid], valid, read

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k, v`` (b, heads, s, d) of the valid new tokens; return every row's (b, heads, T, d)."""
        keys, values = self.cache.k[layer], self.cache.v[layer]
        keys[self.write] = k.transpose(1, 2)[self.valid]                   # (n valid, heads, d)
        values[self.write] = v.transpose(1, 2)[self.valid]
        # the gather, as one index_select of whole slots (rows of heads · d): on a CPU about 4x faster than
        # indexing the (slots, heads, d) pool with the 2-D table (pool[read]), which goes element by element
        shape, rows = (*self.read.shape, *keys.shape[1:]), self.read.reshape(-1)             # (b, T, heads, d)
        k_all = keys.view(keys.shape[0], -1).index_select(0, rows).view(shape)
        v_all = values.view(values.shape[0], -1).index_select(0, rows).view(shape)
        return k_all.transpose(1, 2), v_all.transpose(1, 2)                                  # (b, heads, T, d)
