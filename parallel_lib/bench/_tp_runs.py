"""What each rank of the tensor-parallel benchmark runs: timed training steps, and an all-reduce fit.

Kept apart from :mod:`parallel_lib.bench.tp` (the table) so ranks import only this.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from parallel_lib.common.models import build_gpt2
from parallel_lib.common.saved_tensors import SavedTensors
from parallel_lib.data_parallel.ring import fit_allreduce_cost
from parallel_lib.runtime.collectives import count_collectives
from parallel_lib.tensor_parallel.convert import tensor_parallelize
from parallel_lib.tensor_parallel.sequence import sync_sequence_parallel_grads

__all__ = ["Run", "IMPLEMENTATIONS", "timed_steps", "allreduce_fit", "measure_all"]

IMPLEMENTATIONS = ("course", "course+SP", "DTensor")


@dataclass(frozen=True)
class Run:
    """One measured variant on one rank."""

    step_seconds: float      # median after warm-up, slowest rank (reduced with MAX)
    parameter_bytes: int     # this rank's shard
    activation_bytes: int    # saved for backward by one forward
    wire_bytes: float        # sent by this rank in one step (ring algorithm)


def _model(impl: str, name: str, vocab: int, overrides: dict[str, Any]) -> torch.nn.Module:
    dense = build_gpt2(name, vocab, 0, **overrides)
    if impl == "DTensor" and dist.get_world_size() > 1:
        from torch.distributed.device_mesh import init_device_mesh

        from parallel_lib.tensor_parallel.dtensor import dtensor_parallelize

        return dtensor_parallelize(dense, init_device_mesh("cpu", (dist.get_world_size(),)))
    return tensor_parallelize(dense, None, sequence_parallel=impl == "course+SP" and dist.get_world_size() > 1)


def timed_steps(rank: int, world_size: int, impl: str, name: str, vocab: int, overrides: dict[str, Any],
                batch: int, seq: int, steps: int, warmup: int) -> Run:
    """Train ``steps`` AdamW steps of the ``impl`` split on random tokens; time, count and measure them."""
    model = _model(impl, name, vocab, overrides).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    weights = torch.ones(batch, seq)
    times, activations, wire = [], 0, 0.0
    for k in range(steps):
        dist.barrier()
        start = time.perf_counter()
        with count_collectives() as counter:
            optimizer.zero_grad(set_to_none=True)
            with SavedTensors(model) as saved:
                logits = model(ids, None)
            loss = model.loss(logits, labels, weights)  # the head's: vocabulary-parallel or whole
            loss.backward()
            sync_sequence_parallel_grads(model)
            optimizer.step()
        times.append(time.perf_counter() - start)
        activations, wire = saved.nbytes, counter.wire_bytes()
    median = torch.tensor(statistics.median(times[warmup:]))
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    params = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters()) * 4
    return Run(float(median), params, activations, wire)


def allreduce_fit(rank: int, world_size: int, sizes: tuple[int, ...] = (1 << 10, 1 << 16, 1 << 20, 1 << 22),
                  repeats: int = 5) -> tuple[float, float]:
    """``(bandwidth bytes/s, latency s)`` of this machine's gloo all-reduce, fitted to the ring's α–β model."""
    seconds = []
    for nbytes in sizes:
        x = torch.ones(nbytes // 4)
        dist.all_reduce(x)  # warm-up
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - start)
        seconds.append(statistics.median(times))
    try:
        return fit_allreduce_cost(list(map(float, sizes)), seconds, world_size)
    except ValueError:  # a noisy machine can make a small message look slower than a large one
        n = world_size
        bandwidth = 2 * (n - 1) / n * sizes[-1] / max(seconds[-1] - seconds[0], 1e-9)
        return bandwidth, seconds[0] / (2 * (n - 1))  # the smallest message: latency only


def measure_all(rank: int, world_size: int, jobs: list[tuple[str, str, int, dict[str, Any], int, int]], batch: int,
                seq: int, fit: bool) -> tuple[list[Run], Optional[tuple[float, float]]]:
    """Every ``(impl, model, vocab, overrides, steps, warmup)`` job in turn in this launch, and (``fit``) the all-reduce fit."""
    fitted = allreduce_fit(rank, world_size) if fit else None
    runs = []
    for impl, name, vocab, overrides, steps, warmup in jobs:
        runs.append(timed_steps(rank, world_size, impl, name, vocab, overrides, batch, seq, steps, warmup))
    return runs, fitted
