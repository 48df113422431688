"""Chapter 08's GPU check: every schedule's ``Pipe`` over two devices has one GPU's gradients.

:func:`check_schedules` runs GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-H2, ZB-V and DualPipeV on
GPT-2's stages over ``cuda:0, cuda:1``, compares loss and gradients with one device and times a
step. :mod:`parallel_lib.gpu_checks` registers it as ``schedules``.
"""

from __future__ import annotations

import copy
import statistics
from functools import partial

from parallel_lib.common.tables import markdown_table
from parallel_lib.common.timeline import DeviceClock
from parallel_lib.common.training import weighted_cross_entropy
from parallel_lib.gpu_checks._reference import free_memory, grads_of, max_difference, one_device_reference, workload_for
from parallel_lib.pipeline_parallel.gpt2 import gpt2_stages
from parallel_lib.pipeline_parallel.pipe import Pipe

__all__ = ["check_schedules"]


def check_schedules(n_gpus: int, quick: bool = False) -> str:
    """Chapter 08: every schedule's Pipe over cuda:0, cuda:1 (GPT-2 stages): gradients vs one GPU, step time."""
    from parallel_lib.pipeline_parallel.schedule import make_schedule, stages_per_rank
    workload = workload_for(quick)
    batches, reference, expected = one_device_reference(workload)
    batch = batches[0]
    ids, target = batch["input_ids"], (batch["labels"], batch["label_token_weights"])
    loss_fn = partial(weighted_cross_entropy, denominator=batch["label_token_weights"].sum())
    m = 4 if workload.rows >= 4 else 2  # interleaved needs m a multiple of p = 2
    rows = []
    for name in ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zbv", "dualpipev"):
        if name == "dualpipev" and m < 4:  # DualPipeV needs m >= 2p micro-batches
            rows.append([name, m, f"skipped: needs m >= 4, the batch has {workload.rows} rows", "–"])
            continue
        make_schedule(name, 2, m)  # refuses an m the schedule cannot run
        model = copy.deepcopy(reference)
        stages = gpt2_stages(model, ["cpu"] * (2 * stages_per_rank(name)))  # one Pipe layer per model stage
        with Pipe(stages, [0, 1], chunks=m, schedule=name) as pipe:
            clock, times = DeviceClock(pipe.devices), []
            for _ in range(max(2, workload.repeats)):
                stages.zero_grad(set_to_none=True)
                start = clock()
                got = grads_of(model, pipe.train_step(ids, target, loss_fn, reduction="sum"))
                times.append(clock() - start)
        difference = max_difference(expected, got, f"Pipe {name} on {pipe.devices}")
        rows.append([name, m, f"{difference:.1e}", f"{statistics.median(times[1:]) * 1e3:.1f}"])
        del model, stages
        free_memory()
    return "\n".join([f"Pipeline schedules (chapter 08), GPT-2 ({workload.model}) over 2 devices, loss and gradients "
                      "against one device:", "",
                      markdown_table(["schedule", "m", "max abs difference", "ms / step"], rows, "lrrr")])
