"""The KV cache's size: ``2 · layers · kv_heads · head_dim · tokens · bytes``.

Every token a model has seen leaves a key and a value vector in every layer for every KV head
(grouped-query attention shares one KV head among several query heads: LLaMA-2-70B keeps 8 for its
64, Touvron et al. 2023 §2.2 and table 1). Chapter 09's reserved cache, chapter 03's per-token figure,
the serving calculator and chapter 13's paged pool are all this one product, with the layers and KV
heads a device holds.
"""

from __future__ import annotations

from parallel_lib.common.checks import check_int

__all__ = ["kv_bytes"]


def kv_bytes(layers: int, kv_heads: int, head_dim: int, tokens: int, itemsize: int) -> int:
    """Bytes of keys and values for ``tokens`` tokens over ``layers`` layers and ``kv_heads`` KV heads.

    Args:
        layers: layers the device holds (all, or a pipeline stage's).
        kv_heads: KV heads the device holds (all, or ``kv_heads / tp`` on a tensor-parallel rank).
        head_dim: features per head.
        tokens: token slots (summed over requests; reserved or used).
        itemsize: bytes per element (2 for fp16/bf16, 4 for fp32).

    Raises:
        ValueError: a negative count, or a head size or item size below 1.
    """
    for name, value, least in (("layers", layers, 0), ("kv_heads", kv_heads, 0), ("head_dim", head_dim, 1),
                               ("tokens", tokens, 0), ("itemsize", itemsize, 1)):
        check_int(name, value, minimum=least)
    return 2 * layers * kv_heads * head_dim * tokens * itemsize
