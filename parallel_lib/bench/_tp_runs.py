"""What each rank of the tensor-parallel benchmark runs: timed training steps, and an all-reduce fit.

Kept apart from :mod:`parallel_lib.bench.tp` (the table) so ranks import only this.

Three things make a measurement on a shared 2-core CPU say what the code costs rather than what the
machine was doing (chapter 07's crossover, measured):

- **one step of the dense model beside every step of the split one**, in the same launch: rank 0 runs
  the dense step while the other ranks wait in a barrier (a blocked gloo wait, no CPU), then all run
  the split step. tp = 1 and tp = t see the same load, step by step, instead of two launches minutes apart;
- **CPU time beside wall time**: a step's process CPU time is its work; wall minus CPU is time the
  rank was off a core (waiting in a collective, or not scheduled). tp = t needs t cores at once, tp = 1
  only one: on a machine shared with other jobs the split step loses most;
- **each collective timed inside the step**, and split into the wait for the last rank to arrive
  (imbalance, scheduling) and the transfer after it arrived, so the α–β model can be fitted to the
  collectives a step really runs, not only to an all-reduce repeated in isolation.

Counting (collectives, saved activations) runs in one extra step outside the timed ones: the counter's
dispatch mode sees every operator, which costs a step a few milliseconds of Python.
"""

from __future__ import annotations

import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from parallel_lib.common.models import build_gpt2
from parallel_lib.common.saved_tensors import SavedTensors
from parallel_lib.data_parallel.ring import fit_allreduce_cost
from parallel_lib.runtime.collectives import count_collectives
from parallel_lib.runtime.timed_collectives import timed_collectives
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
    cpu_seconds: float = 0.0        # median process CPU time of a step (largest over ranks): the work
    wait_seconds: float = 0.0       # median per step, in collectives, waiting for the last rank to arrive
    transfer_seconds: float = 0.0   # median per step, in collectives after every rank arrived
    # per call in step order: (kind, message bytes, median transfer s after all arrived, median s in the call)
    collectives: tuple[tuple[str, int, float, float], ...] = ()
    threads: int = 0                # torch.get_num_threads() in the rank


def _model(impl: str, name: str, vocab: int, overrides: dict[str, Any], group: Any = None) -> torch.nn.Module:
    dense = build_gpt2(name, vocab, 0, **overrides)
    if impl == "DTensor" and dist.get_world_size(group) > 1:
        from torch.distributed.device_mesh import init_device_mesh

        from parallel_lib.tensor_parallel.dtensor import dtensor_parallelize

        return dtensor_parallelize(dense, init_device_mesh("cpu", (dist.get_world_size(),)))
    return tensor_parallelize(dense, group, sequence_parallel=impl == "course+SP" and dist.get_world_size(group) > 1)


class _Trainer:
    """One model, its AdamW and a fixed random batch: ``step()`` runs one training step."""

    def __init__(self, impl: str, name: str, vocab: int, overrides: dict[str, Any], batch: int, seq: int,
                 group: Any = None) -> None:
        self.model = _model(impl, name, vocab, overrides, group).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (batch, seq), generator=g)
        self.labels = torch.randint(0, vocab, (batch, seq), generator=g)
        self.weights = torch.ones(batch, seq)

    def step(self, saved: Optional[SavedTensors] = None) -> None:
        """One training step; ``saved`` (a :class:`SavedTensors`) sees the forward's saved tensors."""
        self.optimizer.zero_grad(set_to_none=True)
        with saved if saved is not None else nullcontext():
            logits = self.model(self.ids, None)
        loss = self.model.loss(logits, self.labels, self.weights)  # the head's: vocabulary-parallel or whole
        loss.backward()
        sync_sequence_parallel_grads(self.model)
        self.optimizer.step()

    def counted(self) -> tuple[int, float]:
        """``(activation bytes saved by one forward, bytes sent)`` of one (untimed) step."""
        saved = SavedTensors(self.model)
        with count_collectives() as counter:
            self.step(saved)
        return saved.nbytes, counter.wire_bytes()

    def parameter_bytes(self) -> int:
        return sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in self.model.parameters()) * 4


def _slowest(value: float, group: Any = None) -> float:
    t = torch.tensor(value, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def _waits(calls: list[list[tuple[str, int, float, float]]], group: Any) -> tuple[list[float], list[list[float]]]:
    """Per step: this rank's wait for the last rank's entry; per step and call: the transfer after it."""
    n = dist.get_world_size(group)
    if n == 1 or not calls or not calls[0]:
        return [0.0] * len(calls), [[end - start for _, _, start, end in step] for step in calls]
    entries = torch.tensor([[start for _, _, start, _ in step] for step in calls], dtype=torch.float64)
    everyone = [torch.empty_like(entries) for _ in range(n)]
    dist.all_gather(everyone, entries, group=group)
    last = torch.stack(everyone).amax(0)
    waits = [float((last[k] - entries[k]).clamp_min(0).sum()) for k in range(len(calls))]
    transfers = [[end - max(start, float(last[k, i])) for i, (_, _, start, end) in enumerate(step)]
                 for k, step in enumerate(calls)]
    return waits, transfers


def timed_steps(rank: int, world_size: int, impl: str, name: str, vocab: int, overrides: dict[str, Any],
                batch: int, seq: int, steps: int, warmup: int, paired: bool = False) -> tuple[Run, Optional[Run]]:
    """Train ``steps`` AdamW steps of the ``impl`` split on random tokens; time, count and measure them.

    Args:
        rank, world_size: this rank, and the ranks the split runs over (the launch's).
        impl: one of :data:`IMPLEMENTATIONS`.
        name, vocab, overrides: the GPT-2 (:func:`~parallel_lib.common.models.build_gpt2`).
        batch, seq: the random batch's shape.
        steps, warmup: steps run, and how many of the first are left out of the medians.
        paired: rank 0 also trains the dense model (tp = 1), one dense step before every split step,
            while the other ranks wait in a barrier.

    Returns:
        ``(split run, dense run or None)``: wall and CPU times are medians after ``warmup``, the
        slowest rank's; activations and traffic come from one more step, counted and untimed.
    """
    split = _Trainer(impl, name, vocab, overrides, batch, seq)
    alone = dist.new_group([0]) if paired and world_size > 1 else None  # a group of one: the dense model
    dense = _Trainer("course", name, vocab, overrides, batch, seq, alone) if paired and rank == 0 else None
    walls, cpus, dense_walls, dense_cpus, calls = [], [], [], [], []
    for k in range(steps):
        if paired:
            dist.barrier()
            if dense is not None:
                start, cpu = time.perf_counter(), time.process_time()
                dense.step()
                dense_walls.append(time.perf_counter() - start)
                dense_cpus.append(time.process_time() - cpu)
        dist.barrier()
        with timed_collectives() as step_calls:
            start, cpu = time.perf_counter(), time.process_time()
            split.step()
            walls.append(time.perf_counter() - start)
            cpus.append(time.process_time() - cpu)
        calls.append(step_calls)
    waits, transfers = _waits(calls[warmup:], None)
    per_call = [statistics.median(t) for t in zip(*transfers)] if transfers and transfers[0] else []
    durations = [[end - start for _, _, start, end in step] for step in calls[warmup:]]
    in_call = [statistics.median(t) for t in zip(*durations)]
    kinds = [(kind, nbytes) for kind, nbytes, _, _ in calls[-1]]
    activations, wire = split.counted()
    run = Run(_slowest(statistics.median(walls[warmup:])), split.parameter_bytes(), activations, wire,
              _slowest(statistics.median(cpus[warmup:])), _slowest(statistics.median(waits)),
              _slowest(statistics.median([sum(t) for t in transfers])),
              tuple((kind, nbytes, t, c) for (kind, nbytes), t, c in zip(kinds, per_call, in_call)),
              torch.get_num_threads())
    dense_run = None
    if paired:
        summary = torch.zeros(4, dtype=torch.float64)
        if dense is not None:
            saved, _ = dense.counted()
            summary = torch.tensor([statistics.median(dense_walls[warmup:]), statistics.median(dense_cpus[warmup:]),
                                    dense.parameter_bytes(), saved], dtype=torch.float64)
        dist.broadcast(summary, 0)
        dense_run = Run(float(summary[0]), int(summary[2]), int(summary[3]), 0.0, float(summary[1]),
                        threads=torch.get_num_threads())
    return run, dense_run


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


def measure_all(rank: int, world_size: int, jobs: list[tuple[str, str, int, dict[str, Any], int, int, bool]],
                batch: int, seq: int, fit: bool
                ) -> tuple[list[tuple[Run, Optional[Run]]], Optional[tuple[float, float]]]:
    """Every ``(impl, model, vocab, overrides, steps, warmup, paired)`` job in turn in this launch.

    Returns:
        ``(runs, fit)``: each job's ``(split run, dense run or None)`` (:func:`timed_steps`), and with
        ``fit`` the ``(bandwidth, latency)`` of :func:`allreduce_fit` (else None).
    """
    fitted = allreduce_fit(rank, world_size) if fit else None
    runs = []
    for impl, name, vocab, overrides, steps, warmup, paired in jobs:
        runs.append(timed_steps(rank, world_size, impl, name, vocab, overrides, batch, seq, steps, warmup, paired))
    return runs, fitted
