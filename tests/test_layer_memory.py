"""Memory at layer granularity: parameter counts, per-device bytes of a map, packing, KV cache."""

from itertools import combinations

import pytest

from parallel_lib.cost.shape import SHAPES, GPTShape
from parallel_lib.model_parallel import GiB, get_device_map
from parallel_lib.model_parallel.layer_memory import (device_bytes, kv_cache_bytes_per_token, layer_parameters,
                                                       pack_layers)

# Parameters of the Hugging Face checkpoints (tied weights once), as GPT2LMHeadModel and LlamaForCausalLM
# count them (tests/test_shapes.py builds each on the meta device); Llama 3: its model cards' 8.03B, 70.6B, 406B.
PUBLISHED = {"gpt2 (124M)": 124_439_808, "gpt2-medium (355M)": 354_823_168, "gpt2-large (774M)": 774_030_080,
             "gpt2-xl (1.5B)": 1_557_611_200, "llama-2-7b": 6_738_415_616, "llama-2-13b": 13_015_864_320,
             "llama-2-70b": 68_976_648_192, "llama-3-8b": 8_030_261_248, "llama-3-70b": 70_553_706_496,
             "llama-3-405b": 405_853_388_800}


def test_every_published_shape_has_its_count():
    assert sorted(PUBLISHED) == sorted(SHAPES)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_layer_counts_add_up_to_the_published_parameter_count(name):
    assert sum(n for _, n in layer_parameters(name)) == PUBLISHED[name] == SHAPES[name].parameters()


def test_llama2_7b_layers_by_hand():
    layers = dict(layer_parameters("llama-2-7b"))
    assert layers["embedding"] == 32000 * 4096
    assert layers["block 0"] == 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096
    assert layers["head"] == 32000 * 4096 + 4096  # untied: its own matrix and the final norm


def test_even_map_of_llama2_7b_overflows_its_first_card():
    """Seven 16 GiB cards 'suffice' by division; the even map's first card needs ~17 GiB."""
    per_device = device_bytes("llama-2-7b", get_device_map(32, list(range(7))), 16)
    assert 17 * GiB < per_device[0] < 17.1 * GiB
    assert sum(per_device.values()) == 16 * PUBLISHED["llama-2-7b"]


def _fewest_devices(sizes, capacity):
    """Brute force: the fewest consecutive groups of ``sizes`` each within ``capacity``."""
    for k in range(1, len(sizes) + 1):
        for cuts in combinations(range(1, len(sizes)), k - 1):
            bounds = (0, *cuts, len(sizes))
            if all(sum(sizes[a:b]) <= capacity for a, b in zip(bounds, bounds[1:])):
                return k
    return None


@pytest.mark.parametrize("capacity", [9.0, 11.0, 12.0, 19.0, 20.0, 27.0, 30.0, 45.0, 100.0])
def test_packing_needs_no_more_devices_than_any_map(capacity):
    # layers of 2 (embedding), 9 (each block) and 3 (head) bytes
    shape = GPTShape(n_layer=6, n_embd=1, n_head=1, vocab_size=2, n_positions=0, ffn_hidden=1, gated_mlp=True,
                     rms_norm=True, bias=False, learned_positions=False, tied_head=False)
    sizes = [n for _, n in layer_parameters(shape)]
    packed = pack_layers(shape, capacity, 1.0)
    assert len(packed) == _fewest_devices(sizes, capacity)
    assert sorted(i for ids in packed.values() for i in ids) == list(range(6))
    assert max(device_bytes(shape, packed, 1.0).values()) <= capacity


def test_packing_llama2_7b_on_16_gib_cards():
    packed = pack_layers("llama-2-7b", 16 * GiB, 16)
    assert len(packed) == 7 and len(packed[0]) == 4  # the embedding leaves room for only 4 blocks
    assert max(device_bytes("llama-2-7b", packed, 16).values()) <= 16 * GiB


def test_kv_cache_per_token():
    assert kv_cache_bytes_per_token("llama-2-7b", "fp16") == 2**19  # 0.5 MiB
    assert kv_cache_bytes_per_token("llama-2-70b", "fp16") == 2 * 80 * 8 * 128 * 2  # grouped-query attention
    assert kv_cache_bytes_per_token("gpt2 (124M)", "fp32") == 2 * 12 * 12 * 64 * 4 == 73_728  # every head its own
    assert kv_cache_bytes_per_token("llama-3-8b", "fp16") == 2 * 32 * 8 * 128 * 2 == 131_072  # 8 KV heads of 32


@pytest.mark.parametrize("call, match", [
    (lambda: layer_parameters("llama-3"), "model must be one of"),
    (lambda: kv_cache_bytes_per_token("gpt-5"), "model must be one of"),
    (lambda: kv_cache_bytes_per_token("llama-2-7b", "int3"), "dtype must be one of"),
    (lambda: pack_layers("llama-2-7b", 1 * GiB, 16), "cannot hold the embedding"),
    (lambda: pack_layers("llama-2-7b", 0, 16), "capacity must be > 0"),
    (lambda: device_bytes("llama-2-7b", {0: list(range(31))}, 16), "exactly once"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()
