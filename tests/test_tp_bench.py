"""Smoke test of ``python -m parallel_lib.bench tp``: it runs, and its tables say what they measured and predicted."""

from __future__ import annotations

from dataclasses import replace

import pytest

from parallel_lib.bench.__main__ import main as bench_dispatch
from parallel_lib.bench._tp_runs import Run
from parallel_lib.bench.tp import QUICK, Results, markdown, measure
from parallel_lib.runtime import machine_label


def test_table_from_known_runs():
    runs = {("tiny", 1, "course"): Run(0.010, 900_000, 1_400_000, 0.0),
            ("tiny", 2, "course"): Run(0.008, 500_000, 800_000, 150_000.0),
            ("tiny", 2, "DTensor"): Run(0.009, 500_000, 800_000, 140_000.0)}
    sweep = {(64, 1): 0.010, (64, 2): 0.012, (128, 1): 0.020, (128, 2): 0.015}
    table = markdown(Results(QUICK, "test machine", 1e9, 1e-4, runs, sweep))
    assert "on test machine" in table and "bandwidth 1.00 GB/s, latency 100 µs" in table
    assert "| tiny | 1 | 1 rank (dense) | 10 | 3,200 | 10 | 0.9 | 1.4 | 0.00 |" in table
    dtensor = [line for line in table.splitlines() if line.startswith("| tiny | 2 | DTensor | 9 | 3,556 |")]
    assert len(dtensor) == 1 and dtensor[0].endswith("| 0.14 |")  # DTensor's traffic is counted like the others
    assert "- measured: tp = 2 first beats tp = 1 at width 128" in table
    assert "predicted, NOT measured (H100 NVLink" in table


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="max_tp >= 2 and steps > warmup"):
        measure(replace(QUICK, steps=1))


def test_quick_run_through_the_bench_command(capsys):
    assert bench_dispatch(["tp", "--quick"]) == 0
    out = capsys.readouterr().out
    assert machine_label() in out
    for row in ("| tiny | 1 | 1 rank (dense) |", "| tiny | 2 | course |", "| tiny | 2 | course+SP |",
                "| tiny | 2 | DTensor |", "| 64 |", "| 128 |", "- predicted (α–β, this machine)"):
        assert row in out
    sent = {line.split(" | ")[2]: float(line.split(" | ")[-1].rstrip(" |")) for line in out.splitlines()
            if line.startswith("| tiny | 2 | ")}
    assert sent["DTensor"] > 0 and sent["course"] > 0  # DTensor's functional collectives are counted
