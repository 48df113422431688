"""How many bytes of model state a rank holds, counted and predicted.

:func:`storage_census` counts tensor *storages* (each once, however many views point at it),
by kind: parameters, gradients, optimizer states. Process RSS would also count the Python
interpreter, the allocator's caches and the activations, which say nothing about ZeRO.

:func:`zero_memory` is the ZeRO paper's formula (Rajbhandari et al., 2020, section 3 and
figure 1): with Ψ parameters, N ranks and K bytes of optimizer state per parameter,

    stage 0: (2 + 2 + K) Ψ     stage 1: 2Ψ + 2Ψ + KΨ/N     stage 2: 2Ψ + (2 + K)Ψ/N     stage 3: (2 + 2 + K)Ψ/N

for mixed-precision Adam (bf16/fp16 parameters and gradients, K = 12: fp32 master, momentum,
variance); in fp32 the same with 4 + 4 + 8. :func:`zero_traffic` is the bytes a rank sends per
step under the ring algorithm: stages 0-2 send 2(N-1)/N of the parameters' bytes, stage 3 half
as much again (a second all-gather for the backward).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

from parallel_lib.common.checks import check_choice, check_number, positive_int

__all__ = ["BYTES_PER_PARAM", "storage_census", "optimizer_tensors", "engine_census", "zero_memory", "zero_traffic",
           "zero_paper_table", "megatron_bytes_per_param"]

# precision -> (parameter, gradient, optimizer state) bytes per parameter, with Adam(W)
BYTES_PER_PARAM = {"bf16": (2, 2, 12), "fp32": (4, 4, 8)}
KINDS = ("params", "grads", "optimizer")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), any other tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def storage_census(params: Iterable[Any], grads: Iterable[Any], optimizer: Iterable[Any]) -> dict[str, int]:
    """Bytes of distinct storages by kind; a storage counts once, under the first kind that holds it.

    Args:
        params, grads, optimizer: tensors (or None, skipped; DTensors count their local shard).

    Returns:
        ``{"params": ..., "grads": ..., "optimizer": ..., "total": ...}`` in bytes.
    """
    seen: set[int] = set()
    counts = dict.fromkeys(KINDS, 0)
    for kind, tensors in zip(KINDS, (params, grads, optimizer)):
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = _local(tensor).untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue  # a freed stage-3 buffer, or a view of a storage already counted
            seen.add(storage.data_ptr())
            counts[kind] += storage.nbytes()
    counts["total"] = sum(counts.values())
    return counts


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor in an optimizer's state (moments, step counters)."""
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def engine_census(engine: Any) -> dict[str, int]:
    """:func:`storage_census` of a :class:`~parallel_lib.sharding.zero.ZeroEngine` and its model."""
    params = list(engine.model.parameters()) + [g.shard for g in engine.groups]
    grads = ([p.grad for p in engine.model.parameters()] + list(getattr(engine, "grad_full", []))
             + list(engine.grad_shards) + [s for _, _, _, s in engine._pending])
    optimizer = list(engine.master) + optimizer_tensors(engine.optimizer)
    return storage_census(params, grads, optimizer)


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


def zero_traffic(num_params: float, world_size: int, stage: int, precision: str = "bf16") -> float:
    """Bytes one rank sends per step (ring algorithm) under ZeRO ``stage``.

    Stage 0 all-reduces the gradients, 2(N-1)/N · Ψb; stages 1-2 reduce-scatter them and
    all-gather the parameters, (N-1)/N · Ψb each, the same; stage 3 all-gathers the parameters
    before the forward and again before the backward: 3(N-1)/N · Ψb, 1.5× data parallelism.
    ``b`` is the parameters' bytes per element (2 under bf16, 4 in fp32).
    """
    psi = check_number("num_params", num_params, 0.0)
    n = positive_int("world_size", world_size)
    check_choice("stage", stage, (0, 1, 2, 3))
    b = BYTES_PER_PARAM[check_choice("precision", precision, sorted(BYTES_PER_PARAM))][0]
    return (3 if stage == 3 else 2) * (n - 1) / n * psi * b


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
