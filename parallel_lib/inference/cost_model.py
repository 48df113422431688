"""What serving costs in time: a roofline for prefill and decode, and what each strategy does to it.

Generation has two phases with opposite limits (Williams et al. 2009 for the roofline; Pope et al.
2022, *Efficiently Scaling Transformer Inference*, sec. 2, for its use on transformers):

- **prefill** runs the whole prompt at once: ``2 · params · tokens`` FLOPs against one read of the
  weights, hundreds of FLOPs per byte: *compute-bound*;
- **decode** produces one token per request per step: ``2 · params · batch`` FLOPs against a read of
  every weight and every cached key and value: a few FLOPs per byte: *memory-bound* until the
  batch is large.

A step costs ``max(FLOPs / rate, bytes / bandwidth)`` (both measured on this machine by
:func:`parallel_lib.common.machine_speed.measure_machine_speed`, or published for a GPU) plus a fixed
``overhead`` per layer and forward call (Python and kernel launches: large on a CPU, calibrated from
one measured step by :func:`calibrate_overhead`). Every request of a workload arrives at time 0 with
the same prompt length and asks for the same number of new tokens; a batch runs all of them together.

Per strategy on ``n`` devices, with ``step(b)`` the whole model's step for a batch of ``b``:

- **dp**: each replica serves ``ceil(C/n)`` requests: latency of that batch, throughput up to ×n;
- **mp**: one batch walks the devices in turn: ``step(C)`` plus ``n - 1`` hand-overs: it fits, no faster;
- **pp**: ``G = min(C, n)`` request groups in flight; a stage holds ``1/n`` of the work, so a group's
  token takes ``n`` stage times and the stages work on different groups at once: throughput rises
  only once ``C >= n``, and one request's latency is never below ``step(1)``;
- **tp**: every device does ``1/n`` of every layer, plus two all-reduces of ``b · h`` values per layer
  and token (the α–β model of :func:`parallel_lib.cost.alpha_beta.allreduce_cost`): lower
  per-token latency only where a layer's compute outweighs two all-reduces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

from parallel_lib.common.checks import check_choice, check_int, check_number, positive_int, positive_number
from parallel_lib.cost.alpha_beta import allreduce_cost
from parallel_lib.inference.serving_memory import STRATEGIES, as_shape, kv_cache_bytes, serving_memory
from parallel_lib.cost.shape import GPTShape
from parallel_lib.model_parallel.layer_memory import layer_parameters
from parallel_lib.model_parallel.memory import DTYPE_BYTES, GiB

__all__ = ["Hardware", "GPUS", "hardware_from_speed", "Workload", "Prediction", "matmul_parameters",
           "forward_flops", "forward_bytes", "step_seconds", "predict", "calibrate_overhead", "tp_crossover_width",
           "pareto_front"]


@dataclass(frozen=True)
class Hardware:
    """One device and the link between two of them."""

    name: str
    flops_per_second: float
    bytes_per_second: float          # memory bandwidth
    memory_bytes: float
    link_bandwidth: float            # bytes/s, one direction, between two devices
    link_latency: float              # seconds per message (α of the α–β model)
    overhead: float = 0.0            # seconds per layer per forward call (framework, launches)
    source: str = ""


# Published peak figures (NVIDIA datasheets: A100 80GB SXM, H100 SXM, L4), dense 16-bit tensor-core
# FLOP/s, HBM/GDDR bandwidth, NVLink (or PCIe for L4) per direction; a few µs per message. NOT measured.
GPUS: dict[str, Hardware] = {
    "A100 80GB (published)": Hardware("A100 80GB", 312e12, 2.039e12, 80 * GiB, 300e9, 5e-6,
                                      source="NVIDIA A100 datasheet (published peak, not measured)"),
    "H100 SXM 80GB (published)": Hardware("H100 SXM 80GB", 989e12, 3.35e12, 80 * GiB, 450e9, 5e-6,
                                          source="NVIDIA H100 datasheet (published peak, not measured)"),
    "L4 24GB (published)": Hardware("L4 24GB", 121e12, 300e9, 24 * GiB, 32e9, 10e-6,
                                    source="NVIDIA L4 datasheet (published peak, PCIe 4.0 x16, not measured)"),
}


def hardware_from_speed(speed: Any, memory_bytes: float, link_bandwidth: float, link_latency: float,
                        overhead: float = 0.0, name: str = "this machine") -> Hardware:
    """A :class:`Hardware` from a measured :class:`~parallel_lib.common.machine_speed.MachineSpeed`
    and a fitted link (e.g. :func:`parallel_lib.bench._tp_runs.allreduce_fit` on gloo)."""
    return Hardware(name, positive_number("flops_per_second", speed.flops_per_second),
                    positive_number("bytes_per_second", speed.bytes_per_second), memory_bytes,
                    positive_number("link_bandwidth", link_bandwidth),
                    check_number("link_latency", link_latency, 0.0), check_number("overhead", overhead, 0.0),
                    source=f"measured: {speed.device}, {speed.threads} thread(s), {speed.dtype}")


@dataclass(frozen=True)
class Workload:
    """``concurrency`` requests arriving together, each ``prompt`` tokens long, each asking ``new_tokens``."""

    prompt: int = 16
    new_tokens: int = 16
    concurrency: int = 1
    dtype: str = "fp32"

    def __post_init__(self) -> None:
        for name in ("prompt", "new_tokens", "concurrency"):
            positive_int(name, getattr(self, name))
        check_choice("dtype", self.dtype, DTYPE_BYTES)


@dataclass(frozen=True)
class Prediction:
    """The cost model's answer for one strategy, device count and workload."""

    strategy: str
    n_devices: int
    workload: Workload
    ttft: float                      # seconds from arrival to the first token
    tpot: float                      # seconds per output token after the first, per request
    tokens_per_second: float         # all requests together
    weights_per_device: float        # the fullest device
    kv_per_device: float             # the fullest device, at the end of generation
    fits: Optional[bool] = None      # in the hardware's memory (None: not asked)

    @property
    def latency(self) -> float:
        """Seconds until a request's last token: TTFT plus the remaining tokens."""
        return self.ttft + (self.workload.new_tokens - 1) * self.tpot


def matmul_parameters(model: Any) -> int:
    """Parameters that take part in a matrix product per token: every block, and the output head.

    Embedding lookups cost no FLOPs; a tied head (GPT-2) multiplies by the embedding matrix, so it counts.
    """
    s = as_shape(model)
    layers = layer_parameters(s)
    return sum(n for _, n in layers[1:-1]) + s.vocab_size * s.n_embd


def forward_flops(model: Any, tokens: int, context: float) -> float:
    """FLOPs of one forward over ``tokens`` new tokens that attend to ``context`` tokens on average:
    ``2 · matmul params · tokens`` plus attention's ``4 · layers · hidden · context`` per token."""
    s = as_shape(model)
    return 2.0 * matmul_parameters(s) * tokens + 4.0 * s.n_layer * s.n_embd * context * tokens


def forward_bytes(model: Any, batch: int, context: float, dtype: str = "fp32") -> float:
    """Bytes one forward reads: every weight once, and ``batch`` requests' KV cache of ``context`` tokens."""
    s = as_shape(model)
    width = DTYPE_BYTES[check_choice("dtype", dtype, DTYPE_BYTES)]
    return float(matmul_parameters(s) * width) + float(kv_cache_bytes(s, 1, dtype)) * batch * context


def step_seconds(hw: Hardware, flops: float, nbytes: float, layers: float) -> float:
    """Roofline time of a forward on one device: ``max(FLOPs/rate, bytes/bandwidth)`` plus ``layers``' overhead."""
    return max(flops / hw.flops_per_second, nbytes / hw.bytes_per_second) + layers * hw.overhead


def _hop(hw: Hardware, tokens: int, s: GPTShape, width: int) -> float:
    """Handing ``tokens`` hidden states to the next device."""
    return hw.link_latency + tokens * s.n_embd * width / hw.link_bandwidth


def _phase(hw: Hardware, s: GPTShape, w: Workload, batch: int, prefill: bool, split: int = 1) -> float:
    """One forward of the whole model for ``batch`` requests, its work divided over ``split`` devices
    (the overhead is not: every tensor-parallel rank runs every layer)."""
    tokens = batch * (w.prompt if prefill else 1)
    context = w.prompt / 2 if prefill else w.prompt + w.new_tokens / 2  # average over the phase
    flops = forward_flops(s, tokens, context)
    nbytes = forward_bytes(s, batch, 0 if prefill else context, w.dtype)
    return step_seconds(hw, flops / split, nbytes / split, s.n_layer)


def predict(model: Any, strategy: str, n_devices: int, workload: Workload, hw: Hardware) -> Prediction:
    """TTFT, TPOT, aggregate tokens/s and memory per device of ``workload`` served by ``strategy``.

    See the module docstring for each strategy's formula. ``fits`` compares the fullest device with
    ``hw.memory_bytes``.

    Raises:
        ValueError: an unknown strategy, ``single`` on more than one device, or a tp that does not divide the heads.
    """
    s, w, n = as_shape(model), workload, positive_int("n_devices", n_devices)
    memory = serving_memory(s, check_choice("strategy", strategy, STRATEGIES), n, w.dtype)
    width = DTYPE_BYTES[w.dtype]
    c = w.concurrency
    if strategy in ("single", "dp"):
        batch = math.ceil(c / n) if strategy == "dp" else c
        ttft, tpot = _phase(hw, s, w, batch, True), _phase(hw, s, w, batch, False)
    elif strategy == "mp":
        ttft = _phase(hw, s, w, c, True) + (n - 1) * _hop(hw, c * w.prompt, s, width)
        tpot = _phase(hw, s, w, c, False) + (n - 1) * _hop(hw, c, s, width)
    elif strategy == "pp":
        groups = min(c, n)
        batch = math.ceil(c / groups)
        # a group's token passes n stages of 1/n of the work each; a stage serves the groups in turn
        stage = _phase(hw, s, w, batch, False) / n + _hop(hw, batch, s, width)
        tpot = max(n, groups) * stage
        first = _phase(hw, s, w, batch, True) / n + _hop(hw, batch * w.prompt, s, width)
        ttft = (n + (groups - 1) / 2) * first  # group k's prompt leaves the last stage after n + k slots
    else:  # tp
        ttft = _phase(hw, s, w, c, True, n) + _tp_collectives(hw, s, c * w.prompt, n, width)
        tpot = _phase(hw, s, w, c, False, n) + _tp_collectives(hw, s, c, n, width)
    tokens_per_second = c * w.new_tokens / (ttft + (w.new_tokens - 1) * tpot)
    kv = memory.kv_bytes(c, w.prompt + w.new_tokens)
    weights = max(memory.weights)
    peak = max(a + b for a, b in zip(memory.weights, kv))
    return Prediction(strategy, n, w, ttft, tpot, tokens_per_second, weights, max(kv),
                      peak <= hw.memory_bytes if hw.memory_bytes else None)


def _tp_collectives(hw: Hardware, s: GPTShape, tokens: int, n: int, width: int) -> float:
    """Two all-reduces of the ``tokens × hidden`` activations per layer (after attention and after the MLP)."""
    return 2 * s.n_layer * allreduce_cost(tokens * s.n_embd * width, n, hw.link_bandwidth, hw.link_latency)


def calibrate_overhead(model: Any, hw: Hardware, measured_tpot: float, workload: Workload) -> Hardware:
    """``hw`` with the per-layer overhead that makes the single-device TPOT equal ``measured_tpot``.

    On a CPU a small model's decode step is mostly Python and dispatch, which no roofline sees; one
    measurement (single device, this workload) fixes that constant, and every other strategy and
    concurrency is then a prediction. Never negative: a step faster than the roofline leaves it 0.
    """
    positive_number("measured_tpot", measured_tpot)
    s = as_shape(model)
    bare = replace(hw, overhead=0.0)
    roof = _phase(bare, s, workload, workload.concurrency, False)
    return replace(hw, overhead=max(measured_tpot - roof, 0.0) / s.n_layer)


def tp_crossover_width(hw: Hardware, n_layers: int, batch: int, context: int, tp: int = 2,
                       widths: Optional[Sequence[int]] = None, vocab: int = 1024, dtype: str = "fp32") -> Optional[int]:
    """The smallest width (heads of 64) at which tp devices decode a token faster than one, or None.

    Per layer, tp divides the matrix work and the weight reads by ``tp`` but adds two all-reduces of
    ``batch × width`` values: splitting pays once a layer's share of compute and memory traffic
    outweighs ``2 × (2(tp-1) α + bytes/β)``.
    """
    positive_int("n_layers", n_layers)
    check_int("tp", tp, minimum=2)
    workload = Workload(prompt=positive_int("context", context), new_tokens=1, concurrency=positive_int("batch", batch),
                        dtype=dtype)
    for h in widths or range(64 * tp, 8193, 64 * tp):
        shape = GPTShape(n_layers, h, max(tp, h // 64), vocab, context + 1)
        one = predict(shape, "single", 1, workload, hw).tpot
        many = predict(shape, "tp", tp, workload, hw).tpot
        if many < one:
            return h
    return None


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the ``(latency, throughput)`` points no other point beats on both (lower latency, higher
    throughput), in order of latency: the configurations worth choosing among."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    front: list[int] = []
    for i in order:
        if not front or points[i][1] > points[front[-1]][1]:
            front.append(i)
    return front
