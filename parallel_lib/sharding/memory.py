"""How many bytes of model state a rank holds, counted and predicted.

:func:`storage_census` counts tensor *storages* (each once, however many views point at it),
by kind: parameters, gradients, optimizer states. Process RSS would also count the Python
interpreter, the allocator's caches and the activations, which say nothing about ZeRO.

The formulas the census is checked against, :func:`zero_memory` (the ZeRO paper's bytes per rank)
and :func:`zero_traffic` (what a rank sends per step, micro-batches included), live in the cost
package, :mod:`parallel_lib.cost.zero`; they are re-exported here, beside what they are checked against.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from parallel_lib.cost.zero import BYTES_PER_PARAM, megatron_bytes_per_param, zero_memory, zero_paper_table, zero_traffic

__all__ = ["BYTES_PER_PARAM", "storage_census", "optimizer_tensors", "engine_census", "zero_memory", "zero_traffic",
           "zero_paper_table", "megatron_bytes_per_param"]

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
