"""The KV cache the engine owns: per layer one K and one V tensor, preallocated.

Decoding token ``t`` needs the keys and values of tokens ``0..t-1`` in every layer.
Recomputing them would make each new token cost a whole prefill; keeping them costs
memory instead, and that memory is what limits how many requests a server holds.

**Layout.** For each layer this cache holds ``k`` and ``v`` of shape
``(batch, heads, max_len, head_dim)``, allocated once. Row ``b`` is one request; its
tokens sit in slots ``0 .. length_b - 1`` with no padding in front, so a token's slot
is its position and rows of different lengths share one tensor: an attention mask
(built by :mod:`.batch` from the per-row lengths) hides the slots a row has not filled.
A tensor-parallel rank builds its cache with ``heads = n_head / tp`` (its own heads)
and a pipeline stage with only its layers, so each holds exactly its share.

**Why preallocated, not paged.** vLLM (Kwon et al. 2023, "Efficient Memory Management
for Large Language Model Serving with PagedAttention") stores the cache in fixed-size
blocks and keeps a block table per request, like virtual memory: a request takes
blocks as it grows, nothing is reserved for tokens it may never produce, and requests
can join and leave a running batch (continuous batching) or share a prompt's blocks.
That wins memory (vLLM reports 2-4x throughput) at the cost of an indirection in the
attention kernel. This course runs one batch of requests from start to end, and its
proofs compare tokens with one process; a contiguous tensor per layer keeps the
attention a plain matmul, the census a product of five numbers, and the waste
visible: ``max_len`` is reserved for every row whether it uses it or not.

**Census.** Memory is counted by tensor storage (the course's rule): :meth:`KVCache.nbytes`
sums the bytes of the K and V tensors, which equals
``2 · layers · heads · head_dim · max_len · batch · itemsize``.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from parallel_lib.common.checks import positive_int
from parallel_lib.cost.kv_cache import kv_bytes

__all__ = ["KVCache", "CacheStep", "kv_cache_bytes"]


def kv_cache_bytes(n_layer: int, heads: int, head_dim: int, max_len: int, batch: int, itemsize: int = 4) -> int:
    """The formula the census must equal: ``2 · layers · heads · head_dim · max_len · batch · itemsize``."""
    for name, value in dict(n_layer=n_layer, heads=heads, head_dim=head_dim, max_len=max_len, batch=batch,
                            itemsize=itemsize).items():
        positive_int(name, value)
    return kv_bytes(n_layer, heads, head_dim, max_len * batch, itemsize)


class KVCache:
    """Keys and values of ``layers`` (global layer indices), preallocated for ``batch`` rows of ``max_len`` slots.

    Args:
        layers: the global indices of the layers this cache serves (a pipeline stage's or all).
        batch: rows (requests) it can hold at once.
        heads: attention heads it stores (``n_head / tp`` on a tensor-parallel rank).
        max_len: slots per row: the longest prompt plus new tokens it must hold.
        head_dim: features per head.
        dtype, device: of the tensors.

    Raises:
        ValueError: a count below 1, or no layers.
    """

    def __init__(self, layers: Iterable[int], batch: int, heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None) -> None:
        self.layers = list(layers)
        if not self.layers:
            raise ValueError("layers must name at least one layer, got layers=[]")
        self.batch, self.heads = positive_int("batch", batch), positive_int("heads", heads)
        self.max_len, self.head_dim = positive_int("max_len", max_len), positive_int("head_dim", head_dim)
        shape = (batch, heads, max_len, head_dim)
        # zeros, not empty: a slot read before it is written (it never is, the mask hides it) stays finite
        self.k = {i: torch.zeros(shape, dtype=dtype, device=device) for i in self.layers}
        self.v = {i: torch.zeros(shape, dtype=dtype, device=device) for i in self.layers}

    def check_fits(self, batch: int, length: int) -> None:
        """Raise a ValueError unless ``batch`` rows of ``length`` slots fit in this cache."""
        if batch > self.batch:
            raise ValueError(f"a batch of {batch} requests is larger than the KV cache's batch={self.batch}; "
                             f"split the requests into groups of at most {self.batch} or build a larger cache")
        if length > self.max_len:
            raise ValueError(f"requests needing {length} slots (prompt + new tokens) do not fit the KV cache's "
                             f"max_len={self.max_len}; lower max_new_tokens or build a longer cache")

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' keys and values: ``k, v`` (b, heads, s, d) at ``slots`` (b, s) of rows ``0..b-1``."""
        rows = torch.arange(k.shape[0], device=slots.device)[:, None]  # (b, 1), broadcast against slots (b, s)
        # advanced indices on dims 0 and 2 come out first: the target is (b, s, heads, d)
        self.k[layer][rows, :, slots] = k.transpose(1, 2)
        self.v[layer][rows, :, slots] = v.transpose(1, 2)

    def read(self, layer: int, batch: int, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of rows ``0..batch-1``, slots ``0..upto-1``: two views (batch, heads, upto, d)."""
        return self.k[layer][:batch, :, :upto], self.v[layer][:batch, :, :upto]

    def at(self, slots: torch.Tensor, upto: int) -> CacheStep:
        """This cache as the model's KV store for one pass: write at ``slots`` (b, s), read slots ``0..upto-1``."""
        return CacheStep(self, slots, upto)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache owns (K and V of each layer)."""
        return [t for i in self.layers for t in (self.k[i], self.v[i])]

    def nbytes(self) -> int:
        """Bytes of the cache's tensors (storage census).

        Equals ``2 · layers · heads · head_dim · max_len · batch · itemsize`` (:func:`kv_cache_bytes`).
        """
        return sum(t.untyped_storage().nbytes() for t in self.tensors())

    def bytes_per_token(self) -> int:
        """Bytes one more slot of one row costs: ``2 · layers · heads · head_dim · itemsize`` (:func:`kv_bytes`)."""
        return kv_bytes(len(self.layers), self.heads, self.head_dim, 1, self.k[self.layers[0]].element_size())

    def __repr__(self) -> str:
        t = self.k[self.layers[0]]
        return (f"KVCache(layers={self.layers[0]}..{self.layers[-1]}, batch={self.batch}, heads={self.heads}, "
                f"max_len={self.max_len}, head_dim={self.head_dim}, dtype={t.dtype}, device={t.device}, "
                f"{self.nbytes() / 2**20:.3f} MiB)")



class CacheStep:
    """One forward pass's view of a :class:`KVCache`: what the model's attention calls (its ``KVStore``).

    ``update(layer, k, v)`` writes the new tokens' keys and values at the pass's slots and returns
    every row's slots ``0..upto-1``; the engine's mask hides the ones a row may not see.
    """

    def __init__(self, cache: KVCache, slots: torch.Tensor, upto: int) -> None:
        self.cache, self.slots, self.upto = cache, slots, upto

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.cache.write(layer, self.slots, k, v)
        return self.cache.read(layer, k.shape[0], self.upto)
