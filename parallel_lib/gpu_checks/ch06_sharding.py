"""The GPU checks of Part II (chapters 06–08), beside Part I's in :mod:`parallel_lib.gpu_checks`.

Each function runs its chapter's key run on the GPUs it is given (NCCL ranks, ``cuda:N``
devices), compares with one process and returns the chapter's table; :mod:`parallel_lib.check_gpu`
registers them. They reuse Part I's workload, gradient comparison and clean-up.
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import replace
from functools import partial

from parallel_lib.common.tables import markdown_table
from parallel_lib.common.timeline import DeviceClock
from parallel_lib.common.training import weighted_cross_entropy
from parallel_lib.gpu_checks._reference import (CheckError, _grads, _max_difference, _reference,
                                     free_memory, workload_for)
from parallel_lib.pipeline_parallel.gpt2 import gpt2_stages
from parallel_lib.pipeline_parallel.pipe import Pipe
from parallel_lib.runtime.launcher import launch

__all__ = ["check_sharding", "check_tensor_parallel", "check_schedules"]


def check_sharding(n_gpus: int, quick: bool = False) -> str:
    """ZeRO-0..3 (torch and ring collectives), ZeroRedundancyOptimizer and FSDP2 on ``n_gpus`` ranks train
    like one process; the census matches the formula; then ``bench sharding``'s table at 1 and n ranks."""
    from parallel_lib.bench import sharding as bench_sharding
    from parallel_lib.sharding import ShardConfig, run_many, single_process_reference, zero_memory

    base = ShardConfig(model="tiny", vocab_size=97, batch_size=4 * n_gpus, seq_len=32, steps=3)
    runs = {f"ZeRO-{s}": replace(base, stage=s) for s in range(4)}
    runs.update({"ZeRO-2 ring": replace(base, stage=2, collectives="ring"),
                 "ZeRO-3 ring": replace(base, stage=3, collectives="ring"),
                 "ZeRO-3 prefetch": replace(base, stage=3, prefetch=True),
                 "ZeroRedundancyOptimizer": replace(base, strategy="zero_redundancy"),
                 "FSDP2": replace(base, strategy="fsdp2")})
    per_rank = launch(run_many, n_gpus, runs, timeout=600)
    _, expected, _ = single_process_reference(base)
    rows = []
    for name, config in runs.items():
        results = [r[name] for r in per_rank]
        worst = max(max((r.state[k] - v).abs().max().item() for k, v in expected.items()) for r in results)
        if not worst < 1e-3:  # AdamW turns float noise into ~1e-5 here; a missed shard is ~1e-3 per step
            raise CheckError(f"{name} on {n_gpus} GPUs differs from one process by {worst:.3g}")
        stage = {"ZeroRedundancyOptimizer": 1, "FSDP2": 3}.get(name, config.stage)
        formula = zero_memory(results[0].num_params, n_gpus, stage, config.precision)["total"]
        off = max(abs(r.census["total"] - formula) / formula for r in results)
        if config.strategy == "zero" and not off < 0.05:
            raise CheckError(f"{name}: census {off:.1%} off the formula")
        rows.append([name, f"{worst:.1e}", f"{off:.2%}", f"{results[0].wire_bytes / 1e6:.3f}"])
    table = markdown_table(["variant", "max abs parameter difference", "census off formula", "MB sent per step"],
                           rows, "lrrr")
    bench = bench_sharding.Config(models=("tiny",) if quick else ("tiny", "small"), world_sizes=(1, n_gpus))
    return "\n".join([f"Sharded data parallelism, {n_gpus} NCCL ranks, 3 AdamW steps: every variant's parameters "
                      "match one process on the CPU's:", "", table, "",
                      bench_sharding.markdown(bench_sharding.measure(bench_sharding.QUICK if quick else bench))])


def check_tensor_parallel(n_gpus: int, quick: bool = False) -> str:
    """Chapter 07: tensor-parallel GPT-2 (with and without sequence parallelism) on ``n_gpus`` ranks trains like one process.

    tp is the largest of 4 and 2 that divides ``n_gpus`` (the tiny model has 4 heads); the
    other factor is data parallelism. The reference is one process on the CPU.
    """
    from parallel_lib.tensor_parallel import TPConfig, dense_run, tp_worker

    tp = 4 if n_gpus % 4 == 0 else 2
    rows = []
    for sequence_parallel in (False, True):
        config = TPConfig(tp=tp, sequence_parallel=sequence_parallel, steps=3 if quick else 6)
        results = launch(tp_worker, n_gpus, config, timeout=300)
        losses, state = dense_run(config, results[0].dp)
        worst = max(float((results[0].state[k] - state[k]).abs().max()) for k in state)
        loss_gap = max(abs(a - b) / abs(b) for a, b in zip(results[0].record.losses, losses))
        if worst > 1e-3 or loss_gap > 1e-4:  # AdamW lifts float noise on near-zero gradients to ~lr (1e-3)
            raise CheckError(f"tensor parallel (tp={tp}, sequence_parallel={sequence_parallel}) on {n_gpus} ranks "
                             f"does not match one process: parameters differ by {worst:.3g}, losses by {loss_gap:.3g}")
        record = results[0].record
        rows.append([tp, results[0].dp, "yes" if sequence_parallel else "no", f"{worst:.1e}", f"{loss_gap:.1e}",
                     f"{record.throughput(skip=1):,.0f}", f"{results[0].activation_bytes / 1e6:.2f}"])
    return "\n".join([f"Tensor parallelism on {n_gpus} ranks ({launch.__module__} picks NCCL with a GPU per rank): "
                      "the gathered parameters after AdamW steps match one process on the CPU:", "",
                      markdown_table(["tp", "dp", "sequence parallel", "max abs parameter difference",
                                      "max relative loss difference", "target tokens/s (rank 0)",
                                      "activations MB (rank 0)"], rows, "rrlrrrr")])


# --------------------------------------------------------------------------- chapter 08


def check_schedules(n_gpus: int, quick: bool = False) -> str:
    """Chapter 08: every schedule's Pipe over cuda:0, cuda:1 (GPT-2 stages): gradients vs one GPU, step time."""
    from parallel_lib.pipeline_parallel.schedule import make_schedule, stages_per_rank
    workload = workload_for(quick)
    batches, reference, expected = _reference(workload)
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
                got = _grads(model, pipe.train_step(ids, target, loss_fn, reduction="sum"))
                times.append(clock() - start)
        difference = _max_difference(expected, got, f"Pipe {name} on {pipe.devices}")
        rows.append([name, m, f"{difference:.1e}", f"{statistics.median(times[1:]) * 1e3:.1f}"])
        del model, stages
        free_memory()
    return "\n".join([f"Pipeline schedules (chapter 08), GPT-2 ({workload.model}) over 2 devices, loss and gradients "
                      "against one device:", "",
                      markdown_table(["schedule", "m", "max abs difference", "ms / step"], rows, "lrrr")])
