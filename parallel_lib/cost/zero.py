"""ZeRO's bytes per rank: the model state it keeps, and what it sends per step with its micro-batches.

**Memory** (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", sec. 3 and figure 1): with Ψ parameters, N ranks and K bytes of optimizer state per parameter,

    stage 0: (2 + 2 + K) Ψ     stage 1: 2Ψ + 2Ψ + KΨ/N     stage 2: 2Ψ + (2 + K)Ψ/N     stage 3: (2 + 2 + K)Ψ/N

for mixed-precision Adam (bf16/fp16 parameters and gradients, K = 12: fp32 master, momentum,
variance); in fp32 the same with 4 + 4 + 8.

**Traffic**, per rank and step under the ring algorithm (``(N-1)/N`` of a tensor per pass: a
reduce-scatter or an all-gather is one pass, an all-reduce two), with ``m`` micro-batches per step
(gradient accumulation, or a pipeline's micro-batches):

    stage 0   one all-reduce of the accumulated gradients after the last micro-batch    2 passes
    stage 1   one reduce-scatter of the accumulated gradients, one all-gather of the
              updated parameters                                                        2 passes
    stage 2   a reduce-scatter after EVERY micro-batch's backward (the gradients are
              sharded as they are made: holding them whole until the last micro-batch
              would be stage 1's memory), one all-gather after the step                 m + 1 passes
    stage 3   for every micro-batch an all-gather before its forward, another before
              its backward (the parameters were freed in between) and a reduce-scatter  3m passes

So with one micro-batch stages 0-2 send the same and stage 3 half as much again (the ZeRO paper's
1.5×, sec. 7); with gradient accumulation or a pipeline, stage 2 sends (m + 1)/2 and stage 3 3m/2
times what data parallelism sends. That is why the Llama 3 team keeps the parameters gathered from
forward to backward (Llama Team 2024, "The Llama 3 Herd of Models", sec. 3.3.2: they shard optimizer
states and gradients but do not reshard parameters after the forward) and why DeepSpeed refuses
ZeRO-2 and ZeRO-3 under its pipeline engine (``deepspeed/runtime/pipe/engine.py``,
``PipelineEngine.__init__``; DeepSpeed issue #1110). :func:`zero_collectives` gives the calls and
message bytes the course's ``ZeroEngine`` makes, which the collective counter of a real run checks
(``tests/test_cost_zero.py``).
"""

from __future__ import annotations

from typing import Optional, Sequence

from parallel_lib.common.checks import check_choice, check_number, positive_int

__all__ = ["BYTES_PER_PARAM", "zero_memory", "zero_passes", "zero_traffic", "zero_collectives", "zero_paper_table",
           "megatron_bytes_per_param", "zero3_working_set", "deepspeed_estimate", "fsdp_shard_numel"]

# precision -> (parameter, gradient, optimizer state) bytes per parameter, with Adam(W)
BYTES_PER_PARAM = {"bf16": (2, 2, 12), "fp32": (4, 4, 8)}


def zero_memory(num_params: float, world_size: int, stage: int, precision: str = "bf16",
                optimizer_bytes: Optional[float] = None) -> dict[str, float]:
    """Bytes of model state per rank under ZeRO ``stage`` (the ZeRO paper's formula).

    Args:
        num_params: Ψ, the number of (trainable) parameters.
        world_size: N, ranks sharing the state.
        stage: 0 (plain data parallelism) to 3.
        precision: "bf16" (2 + 2 + 12 bytes, mixed-precision Adam) or "fp32" (4 + 4 + 8).
        optimizer_bytes: K, to override the optimizer's bytes per parameter.

    Returns:
        ``{"params", "grads", "optimizer", "total"}`` in bytes.

    Raises:
        ValueError: negative ``num_params``, ``world_size < 1``, unknown stage or precision.
    """
    psi = check_number("num_params", num_params, 0.0)
    n = positive_int("world_size", world_size)
    check_choice("stage", stage, (0, 1, 2, 3))
    p, g, k = BYTES_PER_PARAM[check_choice("precision", precision, sorted(BYTES_PER_PARAM))]
    k = k if optimizer_bytes is None else check_number("optimizer_bytes", optimizer_bytes, 0.0)
    out = {"params": p * psi / (n if stage >= 3 else 1), "grads": g * psi / (n if stage >= 2 else 1),
           "optimizer": k * psi / (n if stage >= 1 else 1)}
    out["total"] = sum(out.values())
    return out


def zero_passes(stage: int, micro_batches: int = 1) -> int:
    """Passes over the parameters' bytes per step (a reduce-scatter or all-gather is one, an all-reduce two).

    Raises:
        ValueError: an unknown stage or ``micro_batches < 1``.
    """
    check_choice("stage", stage, (0, 1, 2, 3))
    m = positive_int("micro_batches", micro_batches, hint="1 without gradient accumulation or a pipeline")
    return {0: 2, 1: 2, 2: m + 1, 3: 3 * m}[stage]


def zero_traffic(num_params: float, world_size: int, stage: int, precision: str = "bf16",
                 micro_batches: int = 1) -> float:
    """Bytes one rank sends per step (ring algorithm) under ZeRO ``stage`` with ``micro_batches`` per step.

    ``zero_passes(stage, micro_batches) · (N-1)/N · Ψb``, ``b`` the parameters' bytes per element
    (2 under bf16, 4 in fp32; gradients travel in the same width). See the module docstring.

    Raises:
        ValueError: negative ``num_params``, ``world_size < 1``, unknown stage or precision, ``micro_batches < 1``.
    """
    psi = check_number("num_params", num_params, 0.0)
    n = positive_int("world_size", world_size)
    b = BYTES_PER_PARAM[check_choice("precision", precision, sorted(BYTES_PER_PARAM))][0]
    return zero_passes(stage, micro_batches) * (n - 1) / n * psi * b


def zero_collectives(group_bytes: Sequence[float], stage: int, micro_batches: int = 1) -> dict[str, tuple[int, float]]:
    """One step's data-parallel collectives over flat groups of ``group_bytes`` each (padded, whole).

    Returns ``{collective: (calls, message bytes)}`` as the collective counter records them (a
    reduce-scatter by its input, an all-gather by its output, both the whole group): stage 0 one
    all-reduce per group; stage 1 one reduce-scatter and one all-gather per group; stage 2 a
    reduce-scatter per group and micro-batch, one all-gather per group; stage 3 two all-gathers
    and a reduce-scatter per group and micro-batch.

    Raises:
        ValueError: an unknown stage, ``micro_batches < 1`` or a negative group size.
    """
    zero_passes(stage, micro_batches)  # checks stage and micro_batches
    for i, nbytes in enumerate(group_bytes):
        check_number(f"group_bytes[{i}]", nbytes, 0.0)
    n, total, m = len(group_bytes), float(sum(group_bytes)), micro_batches
    if stage == 0:
        calls = {"all_reduce": (n, total)}
    elif stage == 1:
        calls = {"reduce_scatter": (n, total), "all_gather": (n, total)}
    elif stage == 2:
        calls = {"reduce_scatter": (m * n, m * total), "all_gather": (n, total)}
    else:
        calls = {"all_gather": (2 * m * n, 2 * m * total), "reduce_scatter": (m * n, m * total)}
    return {kind: (c, b) for kind, (c, b) in calls.items() if c}


def zero_paper_table(num_params: float = 7.5e9, world_size: int = 64) -> list[tuple[int, float]]:
    """``(stage, GB per GPU)`` for mixed-precision Adam: 120 / 31.4 / 16.6 / 1.9 GB in the ZeRO paper's figure 1."""
    return [(stage, zero_memory(num_params, world_size, stage, "bf16")["total"] / 1e9) for stage in range(4)]


def megatron_bytes_per_param(world_size: int) -> list[tuple[str, float, float, str]]:
    """Megatron-LM's distributed-optimizer table (docs/source/distrib_optimizer.md): bytes per parameter.

    Returns ``(parameters and gradients, without, with the distributed optimizer over d ranks, why)``:
    Megatron keeps fp32 "main" gradients beside fp16 ones, and accumulates bf16 training's
    gradients in fp32, so its totals (20, 18) exceed the ZeRO paper's 16.
    """
    d = positive_int("world_size", world_size)
    return [("fp16 params, fp16 grads", 20, 4 + 16 / d, "2+2 kept; fp32 main grad 4 + master 4 + moments 8 sharded"),
            ("bf16 params, fp32 grads", 18, 6 + 12 / d, "2+4 kept; master 4 + moments 8 sharded"),
            ("fp32 params, fp32 grads", 16, 8 + 8 / d, "4+4 kept; moments 8 sharded")]


def zero3_working_set(layer_params: Sequence[int], outer_params: int, prefetch: bool = True,
                      param_bytes: float = 2, grad_bytes: float = 2) -> dict[str, float]:
    """Bytes a ZeRO-3 rank holds whole, beyond its shards, at the peak of a step (the course's ``ZeroEngine``).

    Between steps a ZeRO-3 rank keeps only its 1/N shards (:func:`zero_memory`); while a micro-batch
    runs it also holds gathered copies. The engine's hooks (:mod:`parallel_lib.sharding.layers`) keep
    the group outside the layers (embeddings, final norm, the tied head) gathered from the start of
    the forward to the end of the backward, gather a layer group just before it computes and, with
    ``prefetch``, the next one while it does. In the backward the layer group's gradients are whole
    until they are reduce-scattered, and so are the outer group's (the head's gradient comes first
    in the backward, the embedding's last):

        params: (outer + largest layer + [prefetch] second largest layer) · param_bytes
        grads:  (outer + largest layer) · grad_bytes

    The ZeRO paper's 16Ψ/N (sec. 5) and DeepSpeed's estimator (:func:`deepspeed_estimate`) count
    less: the paper nothing gathered, DeepSpeed one layer's parameters and gradients.

    Args:
        layer_params: elements of each layer group on this rank.
        outer_params: elements outside the layer groups (0 if the stage holds none).
        prefetch: the next layer group is gathered while the current one computes.
        param_bytes, grad_bytes: bytes per element of the gathered parameters and of the gradients.

    Returns:
        ``{"params", "grads", "total"}`` in bytes.

    Raises:
        ValueError: no layer group, or a negative size.
    """
    if not layer_params:
        raise ValueError("layer_params must list at least one layer group's elements, got an empty list")
    for i, n in enumerate(layer_params):
        check_number(f"layer_params[{i}]", n, 0.0)
    outer = check_number("outer_params", outer_params, 0.0)
    largest = sorted(layer_params, reverse=True)
    gathered = outer + largest[0] + (largest[1] if prefetch and len(largest) > 1 else 0)
    out = {"params": gathered * param_bytes, "grads": (outer + largest[0]) * grad_bytes}
    out["total"] = out["params"] + out["grads"]
    return out


def deepspeed_estimate(num_params: float, world_size: int, stage: int, largest_layer_params: float = 0.0) -> float:
    """GPU bytes per rank by DeepSpeed's estimators, without offloading (their conventions, not ours).

    ``estimate_zero2_model_states_mem_needs`` (``deepspeed/runtime/zero/stage_1_and_2.py``):
    ``2Ψ + 18Ψ/N`` (16-bit parameters whole; 16-bit and fp32 gradients, fp32 master and two moments
    sharded). ``estimate_zero3_model_states_mem_needs`` (``deepspeed/runtime/zero/stage3.py``):
    ``4 · largest layer + 18Ψ/N`` (one layer's 16-bit parameters and gradients whole). "Largest layer"
    is the module with the most parameters of its own (GPT-2's or Llama's token embedding).

    Raises:
        ValueError: a stage other than 2 or 3, a negative size or ``world_size < 1``.
    """
    psi = check_number("num_params", num_params, 0.0)
    n = positive_int("world_size", world_size)
    check_choice("stage", stage, (2, 3))
    largest = check_number("largest_layer_params", largest_layer_params, 0.0)
    return (2 * psi if stage == 2 else 4 * largest) + 18 * psi / n


def fsdp_shard_numel(shapes: Sequence[Sequence[int]], world_size: int) -> int:
    """Elements of one rank's FSDP2 shards, padding included: ``Σ ceil(d0 / N) · (the other dimensions)``.

    PyTorch's ``fully_shard`` splits every parameter along its first dimension into ``N`` chunks of
    ``ceil(d0 / N)`` rows and pads the last ones to that size (its all-gather needs equal chunks), so a
    rank holds more than ``Ψ / N``: at 1,024 ranks a 1,600-wide LayerNorm weight costs 2 elements per
    rank, not 1.56, and GPT-2 XL's shard is 1.22 × ``Ψ / N``. Rank 0's ``to_local()`` is this size.

    Raises:
        ValueError: ``world_size < 1`` or a shape with a dimension below 1.
    """
    n = positive_int("world_size", world_size)
    total = 0
    for i, shape in enumerate(shapes):
        if not shape or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape):
            raise ValueError(f"shapes[{i}] must be positive ints, got {tuple(shape)!r}")
        rest = 1
        for d in shape[1:]:
            rest *= d
        total += -(-shape[0] // n) * rest
    return total
