"""Serving memory: the weights each device holds and the KV cache every request adds.

Training memory is dominated by optimizer states (chapter 03); serving memory by two things only:
the weights, held once per replica, and the KV cache, which grows by
``2 · layers · kv_heads · head_dim · bytes`` with every token of every request in flight
(:func:`~parallel_lib.cost.kv_cache.kv_bytes`, the course's one KV formula). What is left of a
device after the weights, divided by one request's cache, is how many requests it can serve at once:
the number that decides a server's throughput.

Each strategy divides the two differently, per device:

========  ==========================================  =================================
strategy  weights                                     KV cache
========  ==========================================  =================================
single    the whole model                             every layer, every request
dp        the whole model on each replica             every layer, its own requests
mp, pp    its layers (whole layers, chapter 03's map)  its layers, every request
tp        1/t of every matrix, norms whole            its KV heads (1/t), every request
========  ==========================================  =================================

Models are the course's one shape, :class:`~parallel_lib.cost.shape.GPTShape`: a published name from
:data:`~parallel_lib.cost.shape.SHAPES`, a shape, or a course model's ``GPT2Config`` (:func:`as_shape`).
Sizes in bytes; "80 GB" cards hold 80 GiB.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from parallel_lib.common.checks import check_choice, check_int, positive_int, positive_number
from parallel_lib.cost.kv_cache import kv_bytes
from parallel_lib.cost.shape import SHAPES, GPTShape, shape_of
from parallel_lib.model_parallel.device_map import get_device_map
from parallel_lib.model_parallel.layer_memory import device_bytes
from parallel_lib.model_parallel.memory import DTYPE_BYTES, GiB

__all__ = ["STRATEGIES", "as_shape", "kv_heads_per_rank", "kv_cache_bytes", "weights_per_device",
           "ServingMemory", "serving_memory", "max_concurrent_requests", "GiB", "check_memory_bytes"]

STRATEGIES = ("single", "dp", "mp", "pp", "tp")


def check_memory_bytes(name: str, value: Any) -> float:
    """``value`` as a device's memory in bytes: a finite number > 0, and at least a MiB.

    A device of less than 1 MiB is a size given in GiB (``80`` for an 80 GB card): it would fit
    nothing, silently. The planner (:func:`parallel_lib.planner.search.plan_layouts`) and the
    serving calculator both refuse it here.

    Raises:
        ValueError: not a number, not finite, not > 0, or below 2**20 (GiB rather than bytes).
    """
    number = positive_number(name, value)
    if number < 2**20:
        raise ValueError(f"{name} is in bytes, got {value!r}; for GiB multiply by 2**30 (e.g. 80 * GiB)")
    return number


def as_shape(model: Any) -> GPTShape:
    """A :class:`~parallel_lib.cost.shape.GPTShape` from a published name, a shape or a ``GPT2Config``.

    A config's ``n_inner`` (the MLP's width, 4h when None) is kept.

    Raises:
        ValueError: a name that is not in :data:`~parallel_lib.cost.shape.SHAPES`.
        TypeError: neither a name, a shape nor a config.
    """
    if isinstance(model, (str, GPTShape)):
        return shape_of(model)
    if all(hasattr(model, k) for k in ("n_embd", "n_layer", "n_head", "vocab_size", "n_positions")):
        return replace(GPTShape.of(model), ffn_hidden=int(getattr(model, "n_inner", None) or 0))
    raise TypeError(f"model must be a name in {sorted(SHAPES)}, a GPTShape or a GPT2Config, "
                    f"got {type(model).__name__}")


def kv_heads_per_rank(model: Any, tp: int) -> int:
    """KV heads one tensor-parallel rank keeps: ``kv_heads / tp``, or 1 (a replicated head) when tp > kv_heads.

    With grouped-query attention there may be fewer KV heads than ranks (LLaMA-2-70B: 8); each rank
    then keeps a copy of the one KV head its query heads read, as vLLM does.

    Raises:
        ValueError: tp does not divide the query heads, or neither of tp and kv_heads divides the other.
    """
    s, tp = as_shape(model), positive_int("tp", tp)
    heads, kv = s.n_head, s.kv_heads or s.n_head
    if heads % tp or (kv % tp and tp % kv):
        good = [t for t in range(1, heads + 1) if not heads % t and not (kv % t and t % kv)]
        raise ValueError(f"tp={tp} must divide n_heads={heads} and divide or be a multiple of "
                         f"kv_heads={kv}; choose tp among {good}")
    return max(kv // tp, 1)


def kv_cache_bytes(model: Any, tokens: int, dtype: str = "fp16", tp: int = 1, layers: int | None = None) -> int:
    """Bytes of KV cache for ``tokens`` tokens (summed over requests) on one device.

    ``2 · layers · kv_heads_per_rank · head_dim · bytes · tokens``: a key and a value vector per
    layer, KV head and token. ``layers`` (default: all) is how many layers the device holds (mp, pp).
    """
    s = as_shape(model)
    tokens = check_int("tokens", tokens, minimum=0)
    layers = s.n_layer if layers is None else check_int("layers", layers, minimum=0, maximum=s.n_layer)
    width = DTYPE_BYTES[check_choice("dtype", dtype, DTYPE_BYTES)]
    return kv_bytes(layers, kv_heads_per_rank(s, tp), s.n_embd // s.n_head, tokens, width)


def _tp_parameters(s: GPTShape, tp: int, vocab_parallel: bool = True) -> int:
    """Parameters one tensor-parallel rank holds: :meth:`GPTShape.block_parameters` of a shape whose KV heads
    are the ranks' (a KV head replicated on each rank when there are more ranks than KV heads), the
    vocabulary /t (or whole, without ``vocab_parallel``), norms and positions whole."""
    held = replace(s, kv_heads=kv_heads_per_rank(s, tp) * tp)  # checks tp
    outer = held.outer_parameters(tp if vocab_parallel else 1)
    return s.n_layer * held.block_parameters(tp) + sum(outer.values())


def _device_layers(s: GPTShape, strategy: str, n: int) -> list[list[int]]:
    if strategy in ("mp", "pp"):
        if n > s.n_layer:
            raise ValueError(f"strategy {strategy!r} places whole layers: n_devices={n} is more than the model's "
                             f"{s.n_layer} layers, and a device without layers serves nothing; use at most "
                             f"{s.n_layer} devices, or tp")
        return list(get_device_map(s.n_layer, list(range(n))).values())
    return [list(range(s.n_layer))] * n


def weights_per_device(model: Any, strategy: str, n_devices: int = 1, dtype: str = "fp16",
                       vocab_parallel: bool = True) -> list[float]:
    """Weight bytes on each of ``n_devices`` devices under ``strategy`` (one of :data:`STRATEGIES`).

    mp and pp place whole layers with chapter 03's balanced map, the embedding with the first
    device and the head with the last; tp splits every matrix by heads (or MLP columns/rows) and the
    vocabulary by rows (Megatron's vocabulary-parallel embedding, chapter 07; ``vocab_parallel=False``:
    every rank keeps the whole embedding, as the course's serving engine does), and keeps norms and
    position embeddings whole on every rank.

    Raises:
        ValueError: an unknown strategy or dtype, ``single`` on more than one device, mp or pp on more
            devices than layers, or a tp that does not divide the heads.
    """
    s, n = as_shape(model), positive_int("n_devices", n_devices)
    check_choice("strategy", strategy, STRATEGIES)
    width = DTYPE_BYTES[check_choice("dtype", dtype, DTYPE_BYTES)]
    if strategy == "single" and n != 1:
        raise ValueError(f"strategy 'single' runs on one device, got n_devices={n}; choose dp, mp, pp or tp")
    if strategy in ("mp", "pp"):
        return list(device_bytes(s, dict(enumerate(_device_layers(s, strategy, n))), width).values())
    if strategy == "tp":
        return [float(_tp_parameters(s, n, vocab_parallel) * width)] * n
    return [float(s.parameters() * width)] * n


@dataclass(frozen=True)
class ServingMemory:
    """Per device: weight bytes and KV-cache bytes per token in flight (for the requests it serves)."""

    model: GPTShape
    strategy: str
    n_devices: int
    dtype: str
    weights: tuple[float, ...]               # bytes on each device
    kv_per_token: tuple[int, ...]            # cache bytes each device adds per token in flight

    @property
    def replicas(self) -> int:
        """Independent copies of the model: each serves its own requests (dp), else 1."""
        return self.n_devices if self.strategy == "dp" else 1

    def kv_bytes(self, requests: int, tokens_per_request: int) -> list[float]:
        """KV-cache bytes on each device with ``requests`` in flight of ``tokens_per_request`` tokens each
        (dp: the requests spread over the replicas, the first ones taking the remainder)."""
        requests = check_int("requests", requests, minimum=0)
        tokens = check_int("tokens_per_request", tokens_per_request, minimum=0)
        share = [requests // self.replicas + (i < requests % self.replicas) for i in range(self.replicas)]
        if self.strategy != "dp":
            share = share * self.n_devices
        return [float(k * r * tokens) for k, r in zip(self.kv_per_token, share)]

    def total_bytes(self, requests: int, tokens_per_request: int) -> list[float]:
        """Weights plus KV cache on each device."""
        return [w + kv for w, kv in zip(self.weights, self.kv_bytes(requests, tokens_per_request))]

    def max_requests(self, capacity: float, tokens_per_request: int) -> int:
        """Requests of ``tokens_per_request`` tokens the whole group holds at once on devices of ``capacity`` bytes
        (0 when the weights alone do not fit).

        Raises:
            ValueError: ``capacity`` not in bytes (see :func:`check_memory_bytes`), or ``tokens_per_request``
                not a positive int or longer than the model's context (its learned positions).
        """
        capacity = check_memory_bytes("capacity", capacity)
        tokens = positive_int("tokens_per_request", tokens_per_request)
        if self.model.learned_positions and tokens > self.model.n_positions:
            raise ValueError(f"tokens_per_request={tokens} is longer than the model's context of "
                             f"{self.model.n_positions} positions; no request can be that long")
        fits = [max(int((capacity - w) // (k * tokens)), 0) if k else 0
                for w, k in zip(self.weights, self.kv_per_token)]
        return sum(fits) if self.strategy == "dp" else min(fits)


def serving_memory(model: Any, strategy: str = "single", n_devices: int = 1, dtype: str = "fp16") -> ServingMemory:
    """Weights and KV cache per device of ``model`` served by ``strategy`` on ``n_devices`` (module docstring)."""
    s = as_shape(model)
    weights = weights_per_device(s, strategy, n_devices, dtype)
    if strategy == "tp":
        kv = [kv_cache_bytes(s, 1, dtype, tp=n_devices)] * n_devices
    else:
        kv = [kv_cache_bytes(s, 1, dtype, layers=len(ids)) for ids in _device_layers(s, strategy, n_devices)]
    return ServingMemory(s, strategy, n_devices, dtype, tuple(weights), tuple(kv))


def max_concurrent_requests(model: Any, capacity: float, tokens_per_request: int, strategy: str = "single",
                            n_devices: int = 1, dtype: str = "fp16") -> int:
    """How many requests of ``tokens_per_request`` tokens fit at once on ``n_devices`` of ``capacity`` bytes.

    E.g. LLaMA-2-7B in fp16 on one 80 GB card at 4,096 tokens per request:
    ``max_concurrent_requests("llama-2-7b", 80 * GiB, 4096)``.

    Raises:
        ValueError: see :meth:`ServingMemory.max_requests` and :func:`weights_per_device`.
    """
    return serving_memory(model, strategy, n_devices, dtype).max_requests(capacity, tokens_per_request)
