"""A model's compute on one rank of this machine: a fixed cost per block and a FLOP rate, fitted.

The matmul rate of :mod:`parallel_lib.common.machine_speed` is what large matrix products reach.
A training step of the course's small GPT-2 models also pays for what is not a matrix product:
dispatching a few dozen kernels per block, autograd's bookkeeping, layer norms, softmax. On a CPU
that costs milliseconds per step and dominates the tiny model. So the calibration times one
rank's forward + backward at four batch sizes and fits

    t(b) = fixed · (L + 1) + training_flops(b) / rate

for ``fixed`` (seconds per block and pass; the embedding and the head count as one more block)
and ``rate`` (FLOP/s reached by this model's products) by least squares, and it times one AdamW
step. A layout's rank then costs ``fixed`` per block it holds and pass, and its share of the FLOPs at ``rate``.
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch

from parallel_lib.common.models import build_gpt2
from parallel_lib.planner.layout import StepCost
from parallel_lib.cost.shape import GPTShape
from parallel_lib.tensor_parallel.cost import training_flops

__all__ = ["step_key", "fit_step_cost", "solve_step_cost", "time_step", "PROBE_BATCH"]

PROBE_BATCH = 8  # the batch whose step time says how much slower a rank runs than one process alone


def step_key(model: str, vocab_size: int, seq_len: int) -> str:
    return f"{model}-v{vocab_size}-s{seq_len}"


def solve_step_cost(shape: GPTShape, seq_len: int, batches: Sequence[int], seconds: Sequence[float],
                    optimizer: float = 0.0) -> StepCost:
    """Least-squares ``fixed`` and ``rate`` of ``t = fixed (L + 1) + flops / rate`` (relative errors weighted alike).

    Raises:
        ValueError: fewer than two distinct batch sizes, or times that do not grow with the batch.
    """
    if len(batches) != len(seconds) or len(set(batches)) < 2:
        raise ValueError(f"need >= 2 distinct batch sizes and their times, got batches={batches}, seconds={seconds}")
    flops = torch.tensor([training_flops(shape, b, seq_len) for b in batches], dtype=torch.float64)
    y = torch.tensor(list(seconds), dtype=torch.float64)
    design = torch.stack([flops, torch.full_like(flops, float(shape.n_layer + 1))], dim=1)
    slope, fixed = torch.linalg.lstsq(design / y[:, None], torch.ones_like(y)[:, None]).solution[:, 0].tolist()
    if slope <= 0:
        raise ValueError(f"times {seconds} do not grow with the batch {batches}: the machine was too busy; rerun")
    if fixed < 0:  # no fixed part: the rate of the largest batch
        return StepCost(0.0, float(flops[-1] / y[-1]), optimizer)
    return StepCost(fixed, 1.0 / slope, optimizer)


def time_step(model: str = "tiny", vocab_size: int = 512, seq_len: int = 64, batch: int = PROBE_BATCH,
              repeats: int = 3) -> float:
    """Median seconds of one forward + backward of ``batch`` sequences on this process, one thread (after a warm-up).

    Run on every rank at once, it measures what a rank of a layout meets: the cores shared with the
    other ranks (and whatever else the machine runs), on the model's own kernels rather than a matmul.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        net = build_gpt2(model, vocab_size=vocab_size, seed=0, n_positions=max(seq_len, 16))
        net.loss_type = "ForCausalLM"
        ids = torch.randint(0, vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(batch))
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            net(input_ids=ids, labels=ids).loss.backward()
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])
    finally:
        torch.set_num_threads(threads)


def fit_step_cost(model: str = "tiny", vocab_size: int = 512, seq_len: int = 64, batches: Sequence[int] = (2, 4, 8, 16),
                  repeats: int = 5) -> StepCost:
    """Time this process's forward + backward (median of ``repeats``) at each batch size, one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        net = build_gpt2(model, vocab_size=vocab_size, seed=0, n_positions=max(seq_len, 16))
        net.loss_type = "ForCausalLM"
        optimizer = torch.optim.AdamW(net.parameters())
        shape = GPTShape.of(net.config)
        seconds, steps = [], []
        for b in batches:
            ids = torch.randint(0, vocab_size, (b, seq_len), generator=torch.Generator().manual_seed(b))
            times = []
            for _ in range(repeats + 1):
                start = time.perf_counter()
                net(input_ids=ids, labels=ids).loss.backward()
                middle = time.perf_counter()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                times.append(middle - start)
                steps.append(time.perf_counter() - middle)
            seconds.append(statistics.median(times[1:]))  # the first: allocation and warm-up
        try:
            return solve_step_cost(shape, seq_len, batches, seconds, statistics.median(steps[1:]))
        except ValueError:  # a busy moment made the small batch slower: no fixed part, the large batch's rate
            rate = training_flops(shape, batches[-1], seq_len) / seconds[-1]
            return StepCost(0.0, rate, statistics.median(steps[1:]))
    finally:
        torch.set_num_threads(threads)
