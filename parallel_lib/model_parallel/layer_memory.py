"""Memory at layer granularity: what each device of a real device map holds.

``training_memory(...).per_device(n)`` divides a model's bytes by ``n`` as if a model could be
cut anywhere. It cannot: a device map hands out whole layers, and the token embedding (131M
parameters for LLaMA-2-7B, as large as two thirds of a decoder layer) sits on the first device
on top of its blocks. This module counts each layer's parameters from the published shapes,
adds them up per device of a map, finds the fewest devices whose memory holds a model when
layers stay whole, and sizes the KV cache that inference adds per token.

Models are the course's one shape, :class:`~parallel_lib.cost.shape.GPTShape` (a published name from
:data:`~parallel_lib.cost.shape.SHAPES` or a shape): the layers add up to
:meth:`GPTShape.parameters <parallel_lib.cost.shape.GPTShape.parameters>`, which
``tests/test_layer_memory.py`` holds against the Hugging Face checkpoints' counts.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from parallel_lib.common.checks import check_choice, check_number
from parallel_lib.cost.kv_cache import kv_bytes
from parallel_lib.cost.shape import GPTShape, shape_of
from parallel_lib.model_parallel.memory import DTYPE_BYTES

__all__ = ["layer_parameters", "device_bytes", "pack_layers", "pack_layer_bytes", "kv_cache_bytes_per_token"]


def layer_parameters(model: str | GPTShape) -> list[tuple[str, int]]:
    """``[("embedding", n), ("block 0", n), ..., ("head", n)]``: parameters layer by layer.

    The embedding holds the token table (and GPT-2's position table); the "head" entry holds the
    final norm and, untied (LLaMA), its own ``vocab x hidden`` matrix; a tied head (GPT-2) shares
    the embedding's weight, so there it is only the final norm.

    Raises:
        ValueError: ``model`` names no model in :data:`~parallel_lib.cost.shape.SHAPES`.
    """
    s = shape_of(model)
    outer = s.outer_parameters()
    head = outer["final_norm"] + outer["head"]
    return ([("embedding", outer["embedding"])] + [(f"block {i}", s.block_parameters()) for i in range(s.n_layer)]
            + [("head", head)])


def device_bytes(model: str | GPTShape, device_map: Mapping[object, Sequence[int]],
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


def pack_layers(model: str | GPTShape, capacity: float, bytes_per_parameter: float) -> dict[int, list[int]]:
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


def kv_cache_bytes_per_token(model: str | GPTShape, dtype: str = "fp16") -> int:
    """Bytes the KV cache grows by per token: ``2 * layers * kv_heads * head_dim * bytes``.

    :func:`~parallel_lib.cost.kv_cache.kv_bytes` for one token. A key and a value vector per layer and KV
    head; grouped-query attention shares a KV head among several query heads, so LLaMA-2-70B keeps 8 of
    its 64. LLaMA-2-7B in fp16: 0.5 MiB per token.

    Raises:
        ValueError: an unknown model or dtype.
    """
    s = shape_of(model)
    width = DTYPE_BYTES[check_choice("dtype", dtype, DTYPE_BYTES)]
    return kv_bytes(s.n_layer, s.kv_heads or s.n_head, s.n_embd // s.n_head, 1, width)
