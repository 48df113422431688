"""A model's compute on one rank of this machine: a fixed cost per block and a FLOP rate, fitted.

The matmul rate of :mod:`parallel_lib.common.machine_speed` is what large matrix products reach.
A training step of the course's small GPT-2 models also pays for what is not a matrix product:
dispatching a few dozen kernels per block, autograd's bookkeeping, layer norms, softmax. On a CPU
that costs milliseconds per step and dominates the tiny model. So the calibration times one
rank's forward + backward at four batch sizes, through the training entry's own code
(:func:`entry_step`: the model as :mod:`parallel_lib.training.run` converts it, driven by the
pipeline runtime's runner), and fits

    t(b) = fixed · (L + 1) + training_flops(b) / rate

for ``fixed`` (seconds per block and pass; the embedding and the head count as one more block)
and ``rate`` (FLOP/s reached by this model's products) by least squares; it times the forward alone
(its share of the pass: 1/3 of the FLOPs, but about half the time of the tiny model here, where
every operation's dispatch costs as much forward as backward) and one AdamW step. A layout's rank then costs ``fixed`` per block it holds and pass, and its share of the FLOPs at ``rate``.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from parallel_lib.common.models import build_gpt2
from parallel_lib.planner.layout import StepCost
from parallel_lib.cost.shape import GPTShape
from parallel_lib.tensor_parallel.cost import training_flops

__all__ = ["step_key", "fit_step_cost", "solve_step_cost", "time_step", "entry_step", "PROBE_BATCH"]

PROBE_BATCH = 8  # the batch whose step time says how much slower a rank runs than one process alone


def step_key(model: str, vocab_size: int, seq_len: int) -> str:
    return f"{model}-v{vocab_size}-s{seq_len}"


def solve_step_cost(shape: GPTShape, seq_len: int, batches: Sequence[int], seconds: Sequence[float],
                    optimizer: float = 0.0, forward: float = 1 / 3) -> StepCost:
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
        return StepCost(0.0, float(flops[-1] / y[-1]), optimizer, forward)
    return StepCost(fixed, 1.0 / slope, optimizer, forward)


@contextmanager
def _group_of_one() -> Iterator[Any]:
    """A process group of this rank alone in a launched rank (None in a process without one).

    The training entry converts the model for tensor parallelism over its ``tp`` group; converted over a
    launched rank's default group, the model would be split over every rank of the calibration.
    """
    if not dist.is_initialized():
        yield None  # tensor_parallelize: one rank holding everything
        return
    group = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    try:
        yield group
    finally:
        dist.destroy_process_group(group)


@contextmanager
def entry_step(model: str = "tiny", vocab_size: int = 512, seq_len: int = 64, group: Any = None,
               sequence_parallel: bool = False) -> Iterator[tuple[Callable[..., float], torch.nn.Module]]:
    """``(seconds, stage)``: ``seconds(batch, recompute=False)`` times one forward + backward through the training
    entry's own code (``seconds(batch, parts=True)``: ``(forward, forward + backward)`` of one pass), on this
    process alone (or split over the tensor-parallel ``group``, every member calling
    it with the same batch, with ``sequence_parallel`` or without); ``stage`` is the model it runs (its
    parameters, its config).

    What a layout's rank runs (:mod:`parallel_lib.training.run`): the GPT-2 converted for tensor
    parallelism at tp = 1 (its vocabulary-parallel loss included), one pipeline stage holding it all,
    driven by the pipeline runtime's :class:`~parallel_lib.pipeline_parallel.stage.StageRunner`. A bare
    ``model(ids).loss.backward()`` runs 8–24 % faster on this machine's CPU (measured side by side,
    issue #21), and every layout would be under-predicted by that much.
    """
    from parallel_lib.pipeline_parallel.stage import StageRunner
    from parallel_lib.tensor_parallel.convert import tensor_parallelize
    from parallel_lib.training.tp_stage import TensorParallelStage, stage_loss

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with (nullcontext(group) if group is not None else _group_of_one()) as group:
            net = build_gpt2(model, vocab_size=vocab_size, seed=0, n_positions=max(seq_len, 16))
            stage = TensorParallelStage(tensor_parallelize(net, group, sequence_parallel), 0, 1)
            runner = StageRunner(stage, torch.device("cpu"), first=True)

            def seconds(batch: int, recompute: bool = False, parts: bool = False) -> Any:
                ids = torch.randint(0, vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(batch))
                weights = torch.ones(batch, seq_len)
                start = time.perf_counter()
                saved, _ = runner.forward(ids, loss=stage_loss(stage, ids, weights, float(batch * seq_len)),
                                          recompute=recompute)
                forward = time.perf_counter() - start
                runner.backward(saved, None)  # the forward timed inside a whole pass: alone it ran 1.3x slower here
                whole = time.perf_counter() - start
                return (forward, whole) if parts else whole

            yield seconds, stage
    finally:
        torch.set_num_threads(threads)


def time_step(model: str = "tiny", vocab_size: int = 512, seq_len: int = 64, batch: int = PROBE_BATCH,
              repeats: int = 3) -> float:
    """Median seconds of one forward + backward of ``batch`` sequences on this process, one thread (after a warm-up).

    Run on every rank at once, it measures what a rank of a layout meets: the cores shared with the
    other ranks (and whatever else the machine runs), on the training entry's own code
    (:func:`entry_step`) rather than a matmul.
    """
    with entry_step(model, vocab_size, seq_len) as (seconds, _):
        return statistics.median([seconds(batch) for _ in range(repeats + 1)][1:])


def fit_step_cost(model: str = "tiny", vocab_size: int = 512, seq_len: int = 64, batches: Sequence[int] = (2, 4, 8, 16),
                  repeats: int = 5) -> StepCost:
    """Time this process's forward + backward (:func:`entry_step`, median of ``repeats``) at each batch size,
    the forward alone (its share of the pass, the median over the batch sizes), one thread, and one AdamW
    step of the model's parameters."""
    with entry_step(model, vocab_size, seq_len) as (step, stage):
        seconds = [statistics.median([step(b) for _ in range(repeats + 1)][1:]) for b in batches]  # 1st: warm-up
        forward = statistics.median([f / whole for f, whole in (step(b, parts=True) for b in batches
                                                                   for _ in range(repeats))])
        forward = min(max(forward, 0.05), 0.95)  # a busy moment cannot make a pass all forward or all backward
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            optimizer = torch.optim.AdamW(stage.parameters())  # the gradients of the last step are there
            steps = []
            for _ in range(repeats + 1):
                start = time.perf_counter()
                optimizer.step()
                steps.append(time.perf_counter() - start)
        finally:
            torch.set_num_threads(threads)
        shape = GPTShape.of(stage.model.config)
    try:
        return solve_step_cost(shape, seq_len, batches, seconds, statistics.median(steps[1:]), forward)
    except ValueError:  # a busy moment made the small batch slower: no fixed part, the large batch's rate
        rate = training_flops(shape, batches[-1], seq_len) / seconds[-1]
        return StepCost(0.0, rate, statistics.median(steps[1:]), forward)
