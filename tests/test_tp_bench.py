"""Smoke test of ``python -m parallel_lib.bench tp``: it runs, and its tables say what they measured and predicted."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from parallel_lib.bench import _tp_runs
from parallel_lib.bench import tp as tp_bench
from parallel_lib.bench.__main__ import main as bench_dispatch
from parallel_lib.bench._tp_runs import Run, timed_steps
from parallel_lib.runtime.timed_collectives import timed_collectives
from parallel_lib.bench.tp import QUICK, Results, in_step_fit, markdown, measure
from parallel_lib.runtime import count_collectives, machine_label
from parallel_lib.runtime.compat import all_gather_single


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


def test_counting_stays_out_of_the_timed_steps(one_rank_group, monkeypatch):
    # the counter's dispatch mode sees every operator (milliseconds of Python per step): one extra step, untimed
    entered = {"count_collectives": 0, "SavedTensors": 0}

    @contextmanager
    def counting(*args, **kwargs):
        entered["count_collectives"] += 1
        with count_collectives() as counter:
            yield counter

    real_saved = _tp_runs.SavedTensors

    def saved(*args, **kwargs):
        entered["SavedTensors"] += 1
        return real_saved(*args, **kwargs)

    monkeypatch.setattr(_tp_runs, "count_collectives", counting)
    monkeypatch.setattr(_tp_runs, "SavedTensors", saved)
    out = timed_steps(0, 1, "course", "tiny", 64, {}, 2, 8, 4, 1)
    run = out[0] if isinstance(out, tuple) else out
    assert entered == {"count_collectives": 1, "SavedTensors": 1}  # not once per timed step
    assert run.activation_bytes > 0 and run.step_seconds > 0


def test_timed_collectives_record_what_the_counter_counts(one_rank_group):
    x, out, before = torch.ones(250), torch.empty(250), dist.all_reduce
    with count_collectives() as counter, timed_collectives() as calls:
        dist.all_reduce(x)
        all_gather_single(out, x)
    assert [(kind, nbytes) for kind, nbytes, _, _ in calls] == [(c.kind, c.nbytes) for c in counter.calls]
    assert [(kind, nbytes) for kind, nbytes, _, _ in calls] == [("all_reduce", 1000), ("all_gather", 1000)]
    assert all(end >= start for _, _, start, end in calls)
    assert dist.all_reduce is before  # put back


def test_in_step_fit_from_calls():
    # 2 ranks: a ring all-reduce of S bytes sends S bytes in 2 ring steps; calls at exactly 1 GB/s and 0.5 ms a step
    calls = (("all_reduce", 1_000_000, 0.0, 0.002), ("all_reduce", 1_000, 0.0, 0.001001),
             ("all_gather", 10, 0.0, 9.0))  # not an all-reduce: left out
    bandwidth, latency = in_step_fit([Run(1.0, 0, 0, 0.0, collectives=calls),
                                      Run(1.0, 0, 0, 0.0, collectives=(("all_reduce", 2_000_000, 0.0, 0.003),))], 2, 5e9)
    assert bandwidth == pytest.approx(1e9) and latency == pytest.approx(0.0005)
    # one size only: the bandwidth fitted alone is kept, α the median of what is left per ring step
    one_size = (("all_reduce", 1_000_000, 0.0, 0.003), ("all_reduce", 1_000_000, 0.0, 0.005),
                ("all_reduce", 1_000_000, 0.0, 0.009))
    assert in_step_fit([Run(1.0, 0, 0, 0.0, collectives=one_size)], 2, 1e9) == pytest.approx((1e9, 0.002))
    assert in_step_fit([Run(1.0, 0, 0, 0.0)], 2, 1e9) is None


def test_quick_run_through_the_bench_command(capsys, monkeypatch):
    launched = []

    def counting_launch(fn, world_size, *args, **kwargs):
        launched.append(world_size)
        return tp_bench_launch(fn, world_size, *args, **kwargs)

    tp_bench_launch = tp_bench.launch
    monkeypatch.setattr(tp_bench, "launch", counting_launch)
    assert bench_dispatch(["tp", "--quick"]) == 0
    assert launched == [2]  # tp = 1 steps beside tp = 2 in the same launch, under the same load
    out = capsys.readouterr().out
    assert "1 intra-op thread per rank (torch.get_num_threads(), read in every rank)" in out
    calls = {line.split(" | ")[0].lstrip("| "): int(line.split(" | ")[6]) for line in out.splitlines()
             if line.startswith("| tiny course")}
    assert calls == {"tiny course": 21, "tiny course+SP": 48}  # every collective of the step timed (4 blocks)
    assert machine_label() in out
    for row in ("| tiny | 1 | 1 rank (dense) |", "| tiny | 2 | course |", "| tiny | 2 | course+SP |",
                "| tiny | 2 | DTensor |", "| 64 |", "| 128 |", "- predicted (α–β, this machine)"):
        assert row in out
    sent = {line.split(" | ")[2]: float(line.split(" | ")[-1].rstrip(" |")) for line in out.splitlines()
            if line.startswith("| tiny | 2 | ")}
    assert sent["DTensor"] > 0 and sent["course"] > 0  # DTensor's functional collectives are counted
