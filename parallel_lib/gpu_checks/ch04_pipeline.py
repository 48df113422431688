"""Chapter 04's GPU check: the ``Pipe`` over ``cuda:0 .. cuda:p-1`` has one GPU's gradients.

:func:`check_pipeline` cuts GPT-2 into stages on 2, 4, ... devices, compares GPipe's and
1F1B's loss and gradients with one device, times GPipe steps by micro-batch count, then
prints ``python -m parallel_lib.bench pp``'s table. :mod:`parallel_lib.gpu_checks` registers
it as ``pipeline``.
"""

from __future__ import annotations

import copy
import statistics
from functools import partial

from torch import nn

from parallel_lib.bench import pp as bench_pp
from parallel_lib.common.tables import markdown_table
from parallel_lib.common.timeline import DeviceClock
from parallel_lib.common.training import weighted_cross_entropy
from parallel_lib.gpu_checks._reference import (Batch, Grads, Workload, device_counts, free_memory, grads_of,
                                                max_difference, one_device_reference, workload_for)
from parallel_lib.pipeline_parallel.gpt2 import gpt2_stages
from parallel_lib.pipeline_parallel.pipe import Pipe

__all__ = ["check_pipeline"]


def _pipeline_on(p: int, reference: nn.Module, expected: Grads, batch: Batch, workload: Workload
                 ) -> tuple[list[list[object]], list[list[object]]]:
    """Pipe over ``p`` devices: (equivalence rows per schedule, GPipe timing rows per micro-batch count)."""
    ids, target = batch["input_ids"], (batch["labels"], batch["label_token_weights"])
    loss_fn = partial(weighted_cross_entropy, denominator=batch["label_token_weights"].sum())
    tokens = int(batch["label_token_weights"].sum())
    model = copy.deepcopy(reference)
    stages = gpt2_stages(model, list(range(p)))
    matches = []
    for schedule in ("gpipe", "1f1b"):
        with Pipe(stages, stages.devices, chunks=min(4, workload.rows), schedule=schedule) as pipe:
            stages.zero_grad(set_to_none=True)
            got = grads_of(model, pipe.train_step(ids, target, loss_fn, reduction="sum"))
        devices = ", ".join(map(str, pipe.devices))
        matches.append([devices, schedule, f"{max_difference(expected, got, f'Pipe {schedule} on {devices}'):.1e}"])
    timings, step_seconds = [], {}
    for m in workload.micro_batches:
        with Pipe(stages, stages.devices, chunks=m, schedule="gpipe") as pipe:
            clock = DeviceClock(pipe.devices)  # kernels run after the call returns: wait on every stage's device
            times = []
            for _ in range(workload.repeats):
                stages.zero_grad(set_to_none=True)
                start = clock()
                pipe.train_step(ids, target, loss_fn, reduction="sum")
                times.append(clock() - start)
        step_seconds[m] = statistics.median(times[1:])  # the first step warms up
        speedup = step_seconds[workload.micro_batches[0]] / step_seconds[m]
        timings.append([p, m, f"{step_seconds[m] * 1e3:.1f}", f"{tokens / step_seconds[m]:,.0f}", f"{speedup:.2f}×",
                        f"{bench_pp.ideal(m, p):.2f}×"])
    return matches, timings


def check_pipeline(n_gpus: int, quick: bool = False) -> str:
    """Pipe over 2, 4, ... devices: same gradients as one device, GPipe step times; then the PP benchmark."""
    workload = workload_for(quick)
    batches, reference, expected = one_device_reference(workload)
    matches, timings = [], []
    for p in [k for k in device_counts(n_gpus, reference.config.n_layer) if k >= 2]:
        rows = _pipeline_on(p, reference, expected, batches[0], workload)  # stages are freed on return
        matches += rows[0]
        timings += rows[1]
        free_memory()
    results = bench_pp.run(bench_pp.QUICK if quick else bench_pp.Config())
    return "\n".join([
        f"Pipeline parallelism, GPT-2 ({workload.model}) cut by gpt2_stages, {workload.rows} rows x "
        f"{workload.length} positions; loss and gradients against one device:", "",
        markdown_table(["devices", "schedule", "max abs difference"], matches, "llr"), "",
        f"GPipe training step, median of {workload.repeats - 1} timed step(s) after a warm-up:", "",
        markdown_table(["stages", "m", "ms / step", "target tokens/s", f"speedup vs m={workload.micro_batches[0]}",
                        "ideal p·m/(m+p−1)"], timings, "rrrrrr"), "",
        bench_pp.markdown(results)])
