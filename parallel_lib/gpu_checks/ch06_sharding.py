"""Chapter 06's GPU check: ZeRO-0..3, ZeroRedundancyOptimizer and FSDP2 on NCCL ranks train like one process.

Every variant runs through the one training entry (``training.train_many`` of ``zero_plan``s)
and is compared with ``training.reference``.

:func:`check_sharding` compares every variant's parameters with one process, its census with
``zero_memory``'s formula, then prints ``python -m parallel_lib.bench sharding``'s table.
:mod:`parallel_lib.gpu_checks` registers it as ``sharding``.
"""

from __future__ import annotations

from dataclasses import replace

from parallel_lib.common.compare import max_abs_difference
from parallel_lib.common.tables import markdown_table
from parallel_lib.gpu_checks._reference import CheckError
from parallel_lib.runtime.launcher import launch

__all__ = ["check_sharding"]


def check_sharding(n_gpus: int, quick: bool = False) -> str:
    """ZeRO-0..3 (torch and ring collectives), ZeroRedundancyOptimizer and FSDP2 on ``n_gpus`` ranks train
    like one process; the census matches the formula; then ``bench sharding``'s table at 1 and n ranks."""
    from parallel_lib.bench import sharding as bench_sharding
    from parallel_lib.sharding import zero_memory
    from parallel_lib.training import RunConfig, max_difference, reference, train_many, zero_plan

    base = RunConfig(model="tiny", vocab_size=97, batch_size=4 * n_gpus, seq_len=32, steps=3)
    n = n_gpus
    runs = {f"ZeRO-{s}": (zero_plan(n, s), base, s) for s in range(4)}
    runs.update({"ZeRO-2 ring": (zero_plan(n, 2), replace(base, collectives="ring"), 2),
                 "ZeRO-3 ring": (zero_plan(n, 3), replace(base, collectives="ring"), 3),
                 "ZeRO-3 prefetch": (zero_plan(n, 3), replace(base, prefetch=True), 3),
                 "ZeroRedundancyOptimizer": (zero_plan(n, sync="zero_redundancy"), base, 1),
                 "FSDP2": (zero_plan(n, sync="fsdp2"), base, 3)})
    per_rank = launch(train_many, n_gpus, [(plan, run) for plan, run, _ in runs.values()], timeout=600)
    _, expected = reference(base)
    rows = []
    for k, (name, (plan, config, stage)) in enumerate(runs.items()):
        results = [r[k] for r in per_rank]
        worst = max(max_difference(results, expected).values())
        if not worst < 1e-3:  # AdamW turns float noise into ~1e-5 here; a missed shard is ~1e-3 per step
            raise CheckError(f"{name} on {n_gpus} GPUs differs from one process by {worst:.3g}")
        formula = zero_memory(results[0].trainable_parameters, n_gpus, stage, config.precision)["total"]
        off = max(abs(r.census["total"] - formula) / formula for r in results)
        if plan.sync == "zero" and not off < 0.05:
            raise CheckError(f"{name}: census {off:.1%} off the formula")
        rows.append([name, f"{worst:.1e}", f"{off:.2%}", f"{results[0].wire_bytes / 1e6:.3f}"])
    table = markdown_table(["variant", "max abs parameter difference", "census off formula", "MB sent per step"],
                           rows, "lrrr")
    bench = bench_sharding.Config(models=("tiny",) if quick else ("tiny", "small"), world_sizes=(1, n_gpus))
    return "\n".join([f"Sharded data parallelism, {n_gpus} NCCL ranks, 3 AdamW steps: every variant's parameters "
                      "match one process on the CPU's:", "", table, "",
                      bench_sharding.markdown(bench_sharding.measure(bench_sharding.QUICK if quick else bench))])
