"""The one KV-cache formula (``parallel_lib.cost.kv_cache.kv_bytes``) against published figures."""

import pytest

from parallel_lib.cost.kv_cache import kv_bytes


def test_published_kv_cache_sizes():
    # LLaMA-2-7B (Touvron et al. 2023, table 1: 32 layers, 32 heads of 128, no GQA) in fp16: 0.5 MiB per token
    assert kv_bytes(32, 32, 128, 1, 2) == 2**19
    # LLaMA-2-70B: 80 layers, 8 KV heads of 128 (GQA): 320 KiB per token, 2.5 GiB for a 8,192-token batch
    assert kv_bytes(80, 8, 128, 1, 2) == 320 * 2**10
    assert kv_bytes(80, 8, 128, 8192, 2) == 2.5 * 2**30
    # a device holding no layer (an empty stage) or no token holds no cache
    assert kv_bytes(0, 8, 128, 10, 2) == 0 == kv_bytes(80, 8, 128, 0, 2)


@pytest.mark.parametrize("args, name", [((-1, 8, 128, 1, 2), "layers"), ((1, 8, 0, 1, 2), "head_dim"),
                                        ((1, 8, 128, -3, 2), "tokens"), ((1, 8, 128, 1, 0), "itemsize"),
                                        ((1, 8.5, 128, 1, 2), "kv_heads")])
def test_bad_counts_are_named(args, name):
    with pytest.raises((ValueError, TypeError), match=name):
        kv_bytes(*args)
