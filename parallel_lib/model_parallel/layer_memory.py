"""Memory at layer granularity: what each device of a real device map holds.

``training_memory(...).per_device(n)`` divides a model's bytes by ``n`` as if a model could be
cut anywhere. It cannot: a device map hands out whole layers, and the token embedding (131M
parameters for LLaMA-2-7B, as large as two thirds of a decoder layer) sits on the first device
on top of its blocks. This module counts each layer's parameters from the published shapes,
adds them up per device of a map, finds the fewest devices whose memory holds a model when
layers stay whole, and sizes the KV cache that inference adds per token.

Parameter counts reproduce :data:`parallel_lib.model_parallel.memory.MODEL_SHAPES` exactly
(``tests/test_layer_memory.py``), so the two views of a model cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from parallel_lib.common.checks import check_choice, check_number
from parallel_lib.cost.kv_cache import kv_bytes
from parallel_lib.model_parallel.memory import DTYPE_BYTES

__all__ = ["DecoderShape", "DECODER_SHAPES", "layer_parameters", "device_bytes", "pack_layers", "pack_layer_bytes",
           "kv_cache_bytes_per_token"]


@dataclass(frozen=True)
class DecoderShape:
    """A decoder-only transformer, as far as its parameter count and KV cache go."""

    vocab: int
    hidden: int
    n_layers: int
    ffn: int  # MLP inner width
    n_heads: int
    kv_heads: int  # < n_heads with grouped-query attention (LLaMA-2-70B: 8)
    gpt2_style: bool  # True: learned positions, biases, LayerNorm, 4h GELU MLP, tied head; False: LLaMA
    max_positions: int = 0  # learned position embeddings (GPT-2); 0 for rotary embeddings

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads


# GPT-2: Radford et al. 2019 and the Hugging Face configs; LLaMA-2: Touvron et al. 2023, table 1
# and the Hugging Face configs (intermediate_size, num_key_value_heads).
DECODER_SHAPES: dict[str, DecoderShape] = {
    "gpt2 (124M)": DecoderShape(50257, 768, 12, 3072, 12, 12, True, 1024),
    "gpt2-xl (1.5B)": DecoderShape(50257, 1600, 48, 6400, 25, 25, True, 1024),
    "llama-2-7b": DecoderShape(32000, 4096, 32, 11008, 32, 32, False),
    "llama-2-13b": DecoderShape(32000, 5120, 40, 13824, 40, 40, False),
    "llama-2-70b": DecoderShape(32000, 8192, 80, 28672, 64, 8, False),
}


def _shape(model: str | DecoderShape) -> DecoderShape:
    if isinstance(model, DecoderShape):
        return model
    return DECODER_SHAPES[check_choice("model", model, DECODER_SHAPES)]


def layer_parameters(model: str | DecoderShape) -> list[tuple[str, int]]:
    """``[("embedding", n), ("block 0", n), ..., ("head", n)]``: parameters layer by layer.

    A tied head (GPT-2) shares the embedding's weight, so the "head" entry holds only the final
    norm; an untied head (LLaMA) holds the final norm and its own ``vocab x hidden`` matrix.
    """
    s = _shape(model)
    h, f = s.hidden, s.ffn
    kv = s.kv_heads * s.head_dim
    if s.gpt2_style:  # weights + biases: qkv, attention out, MLP in, MLP out; two LayerNorms (weight + bias)
        block = (h * 3 * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h) + 2 * 2 * h
        embedding = s.vocab * h + s.max_positions * h
        head = 2 * h
    else:  # no biases: q, k, v, o; gate, up, down; two RMSNorm weights
        block = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
        embedding = s.vocab * h
        head = h + s.vocab * h
    return [("embedding", embedding)] + [(f"block {i}", block) for i in range(s.n_layers)] + [("head", head)]


def device_bytes(model: str | DecoderShape, device_map: Mapping[object, Sequence[int]],
                 bytes_per_parameter: float) -> dict[object, float]:
    """Bytes each device of ``device_map`` (``{device: [block indices]}``) holds.

    The embedding goes with the first device, the head with the last, as
    :func:`~parallel_lib.model_parallel.parallelize` places an untied model (a tied head's own
    bytes, only its final norm, are tiny wherever it goes).

    Raises:
        ValueError: a map that does not give every block exactly once, or a negative byte count.
    """
    check_number("bytes_per_parameter", bytes_per_parameter, 0)
    layers = layer_parameters(model)
    blocks = [n for name, n in layers[1:-1]]
    given = sorted(i for ids in device_map.values() for i in ids)
    if given != list(range(len(blocks))):
        raise ValueError(f"device_map must give each of the {len(blocks)} blocks exactly once, got {dict(device_map)}")
    keys = list(device_map)
    out = {key: bytes_per_parameter * sum(blocks[i] for i in device_map[key]) for key in keys}
    out[keys[0]] += bytes_per_parameter * layers[0][1]
    out[keys[-1]] += bytes_per_parameter * layers[-1][1]
    return out


def pack_layers(model: str | DecoderShape, capacity: float, bytes_per_parameter: float) -> dict[int, list[int]]:
    """The fewest devices of ``capacity`` bytes that hold the model with whole layers, in order.

    :func:`pack_layer_bytes` on the model's layers at ``bytes_per_parameter`` bytes each.

    Raises:
        ValueError: a non-positive size, or a layer larger than ``capacity``.
    """
    check_number("bytes_per_parameter", bytes_per_parameter, 0, strict=True)
    return pack_layer_bytes([n * bytes_per_parameter for _, n in layer_parameters(model)], capacity)


def pack_layer_bytes(layer_bytes: Sequence[float], capacity: float) -> dict[int, list[int]]:
    """``{device: [block indices]}`` on the fewest devices of ``capacity`` bytes, layers whole and in order.

    ``layer_bytes`` is ``[embedding, block 0, ..., block n-1, head]``. The layers go in order and
    each device takes layers until the next would overflow it: for layers that must stay
    consecutive, this greedy filling needs no more devices than any other map. The embedding counts
    on device 0 and the head on the last device (which may then hold the head alone: its block list
    is empty).

    Raises:
        ValueError: fewer than two entries, a non-positive capacity, or a layer larger than ``capacity``.
    """
    check_number("capacity", capacity, 0, strict=True)
    if len(layer_bytes) < 2:
        raise ValueError(f"layer_bytes must list the embedding, the blocks and the head, got {list(layer_bytes)}")
    device_map: dict[int, list[int]] = {0: []}
    used = 0.0
    last = len(layer_bytes) - 1
    for position, size in enumerate(layer_bytes):
        name = "embedding" if position == 0 else "head" if position == last else f"block {position - 1}"
        if size > capacity:
            raise ValueError(f"capacity={capacity:.4g} bytes cannot hold the {name} ({size:.4g} bytes) alone; "
                             "choose larger devices or a smaller bytes_per_parameter")
        if used + size > capacity:
            device_map[len(device_map)] = []
            used = 0.0
        if 0 < position < last:
            device_map[len(device_map) - 1].append(position - 1)
        used += size
    return device_map


def kv_cache_bytes_per_token(model: str | DecoderShape, dtype: str = "fp16") -> int:
    """Bytes the KV cache grows by per token: ``2 * layers * kv_heads * head_dim * bytes``.

    A key and a value vector per layer and KV head; grouped-query attention shares a KV head among
    several query heads, so LLaMA-2-70B keeps 8 of its 64. LLaMA-2-7B in fp16: 0.5 MiB per token.
    """
    s = _shape(model)
    width = DTYPE_BYTES[check_choice("dtype", dtype, DTYPE_BYTES)]
    return kv_bytes(s.n_layers, s.kv_heads, s.head_dim, 1, width)
