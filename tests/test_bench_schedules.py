"""Smoke run of ``python -m parallel_lib.bench schedules --quick``; the torch comparison and converter."""

import pytest

from parallel_lib.bench import schedules as bench
from parallel_lib.bench.__main__ import main as bench_main
from parallel_lib.pipeline_parallel import make_schedule
from parallel_lib.pipeline_parallel.torch_pp import compare_with_torch, from_torch_actions, to_torch_actions


def test_quick_schedules_benchmark_prints_every_schedule(capsys):
    assert bench_main(["schedules", "--quick"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Pipeline schedules on ")
    for name in bench.NAMES:
        assert f"| {name} | 4 | " in out
    assert "p = 4, simulated from the measured costs:" in out


def test_formula_column_is_the_closed_form():
    assert bench.formula("1f1b", 4, 8) == 3 / 8
    assert bench.formula("interleaved", 4, 8) == 3 / 16
    assert bench.formula("zb-h1", 4, 8) == 3 / 24
    assert bench.formula("zb-h1", 4, 2) is None and bench.formula("zbv", 4, 8) is None


@pytest.mark.parametrize("name", ["1f1b", "interleaved", "zb-h1", "zbv"])
def test_converter_round_trips_through_torch_action_strings(name):
    ours = make_schedule(name, 4, 8)
    text = to_torch_actions(ours)
    assert from_torch_actions(ours.name, text, 8, ours.placement) == ours
    if ours.split_backward:
        assert {t[len(t.rstrip("0123456789")) - 1] for row in text for t in row} == {"F", "I", "W"}


@pytest.mark.parametrize("m", [8, 16])
def test_our_orders_equal_torchs_where_the_schedule_is_the_same(m):
    assert compare_with_torch(make_schedule("interleaved", 4, m)) == "equal"  # Megatron's order, m > p
    assert compare_with_torch(make_schedule("zb-h1", 4, m)) == "equal"  # ScheduleInterleavedZeroBubble, v=1


def test_where_torchs_orders_differ_it_is_listed():
    # m == p: Megatron runs every forward first; PyTorch keeps its 1F1B steady state
    assert compare_with_torch(make_schedule("interleaved", 4, 4)).startswith("rank 2 from action 7")
    assert compare_with_torch(make_schedule("zbv", 4, 8)).startswith("rank 0 from action")  # greedy vs hand-drawn
