"""Smoke test of ``python -m parallel_lib.bench dp``: it runs, and its table says what it measured.

The performance targets are the benchmark's business, not a test's: timings on a
shared CI machine are too noisy to assert.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import parallel_lib
from parallel_lib.bench.__main__ import main as bench_dispatch
from parallel_lib.bench.dp import QUICK, Config, Results, markdown, measure
from parallel_lib.runtime import machine_label


def test_table_from_known_step_times():
    config = Config(world_size=2, per_rank_batch=4, max_length=10, repeats=1)
    results = Results(config, "test machine", "tiny", "cpu",
                      {"1 rank": 0.010, "none": 0.0105, "naive": 0.020, "bucketed": 0.011, "ring": 0.012, "ddp": 0.011})
    table = markdown(results)
    assert "tiny) on test machine" in table
    assert "| 1 rank (baseline) | 1 | 10.0 | 4,000 | 1.00× | 100% | 0.53× |" in table
    assert "| 2 ranks, no sync (ceiling) | 2 | 10.5 | 7,619 | 1.90× | 95% | 1.00× |" in table
    assert "| bucketed | 2 | 11.0 | 7,273 | 1.82× | 91% | 0.95× |" in table
    assert "bucketed: 1.82× one rank" in table and "1.00× DDP" in table
    assert "Warning" not in table
    assert "target" not in markdown(results, targets=False)


def test_table_warns_when_the_ceiling_did_not_scale():
    config = Config(world_size=2, per_rank_batch=4, max_length=10, repeats=1, methods=("bucketed",))
    busy = Results(config, "busy machine", "tiny", "cpu", {"1 rank": 0.010, "none": 0.016, "bucketed": 0.018})
    assert "Warning: 2 workers with no communication at all ran only 1.25x" in markdown(busy)


@pytest.mark.parametrize("change", [dict(world_size=1), dict(methods=("bucketed", "allgather")), dict(steps=1)])
def test_bad_configs_are_rejected(change):
    from dataclasses import replace

    with pytest.raises(ValueError, match="world_size >= 2 and steps > warmup"):
        measure(replace(QUICK, **change))


def test_quick_run_through_the_bench_command(capsys):
    assert bench_dispatch(["dp", "--quick"]) == 0
    out = capsys.readouterr().out
    assert machine_label() in out
    for row in ("| 1 rank (baseline) | 1 |", "| 2 ranks, no sync (ceiling) | 2 |", "| naive | 2 |",
                "| bucketed | 2 |", "| ring | 2 |", "| ddp | 2 |"):
        assert row in out
    assert "bucketed:" in out and "× DDP" in out


# --- every printed table comes from the one helper ------------------------------------------------

GPU_CHECKS = sorted(path.stem for path in (Path(parallel_lib.__file__).parent / "gpu_checks").glob("ch*.py"))
TABLE_MODULES = ["parallel_lib.bench.dp", "parallel_lib.bench.allreduce", "parallel_lib.bench.pp",
                 "parallel_lib.check_gpu", *(f"parallel_lib.gpu_checks.{name}" for name in GPU_CHECKS),
                 "parallel_lib.planner.compare"]


@pytest.mark.parametrize("name", TABLE_MODULES)
def test_no_module_pastes_its_own_separator_row(name):
    import importlib
    import inspect

    source = inspect.getsource(importlib.import_module(name))
    assert "|---" not in source and "---|" not in source, f"{name}: use parallel_lib.common.tables.markdown_table"


def test_benchmark_and_comparison_tables_go_through_markdown_table(monkeypatch):
    import parallel_lib.bench.allreduce as bench_allreduce
    import parallel_lib.bench.dp as bench_dp
    import parallel_lib.bench.pp as bench_pp
    import parallel_lib.common.tables as tables
    from parallel_lib.planner import Measured
    from parallel_lib.planner import markdown_table as comparison_table

    headers, real = [], tables.markdown_table

    def spy(header, rows, align=""):
        headers.append(header[0])
        return real(header, rows, align)

    for module in (bench_dp, bench_allreduce, bench_pp):
        monkeypatch.setattr(module, "markdown_table", spy)
    monkeypatch.setattr(tables, "markdown_table", spy)
    config = Config(world_size=2, per_rank_batch=4, max_length=10, repeats=1, methods=("bucketed",))
    markdown(Results(config, "m", "tiny", "cpu", {"1 rank": 0.01, "none": 0.01, "bucketed": 0.01}))
    bench_allreduce.markdown(bench_allreduce.Results(bench_allreduce.Config(sizes=(1024,)), "m", "gloo",
                                                     seconds={"builtin": {1024: 1e-3}, "ring": {1024: 1e-3}}))
    bench_pp.markdown(bench_pp.Results(bench_pp.Config(micro_batches=(1,)), "m", ["cpu", "cpu"], plain=1.0,
                                       thread_ceiling=1.5, steps={"gpipe": {1: 1.0}}))
    comparison_table([Measured("1 device", 1, 100.0, 4e6, 4e6, 0.0, None, "train()")], machine="m")
    assert headers == ["variant", "size", "runner", "strategy"]
