"""Smoke run of ``python -m parallel_lib.bench schedules --quick``; the torch comparison and converter."""

import os

import pytest

from parallel_lib.bench import schedules as bench
from parallel_lib.bench.__main__ import main as bench_main
from parallel_lib.pipeline_parallel import Action, make_schedule
from parallel_lib.pipeline_parallel.torch_pp import compare_with_torch, from_torch_actions, to_torch_actions


def test_quick_schedules_benchmark_prints_every_schedule(capsys):
    assert bench_main(["schedules", "--quick"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Pipeline schedules on ")
    for name in bench.NAMES:
        assert f"| {name} | 4 | " in out
    assert "p = 4, simulated from the measured costs:" in out
    assert "Split backward (ZB-H1's B + W, summed over stages) against 1F1B's whole backward, same run: m=4: " in out


def test_formula_column_is_the_closed_form():
    assert bench.formula("1f1b", 4, 8) == 3 / 8
    assert bench.formula("interleaved", 4, 8) == 3 / 16
    assert bench.formula("zb-h1", 4, 8) == 3 / 24
    assert bench.formula("zbv", 4, 8) == 0 and bench.formula("dualpipev", 4, 8) == 3 / 48
    assert bench.formula("zb-h1", 4, 2) is None and bench.formula("zbv", 4, 6) is None


@pytest.mark.parametrize("name", ["1f1b", "interleaved", "zb-h1", "zbv", "dualpipev"])
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
    assert compare_with_torch(make_schedule("dualpipev", 4, m)) == "equal"  # whole backwards as B then W


@pytest.mark.parametrize("p", range(1, 9))
def test_zbv_is_torchs_zbv_for_every_m(p):
    for m in range(1, 17):  # m < 2p - 1 too: both drop the actions of micro-batches that do not exist
        assert compare_with_torch(make_schedule("zbv", p, m)) == "equal", (p, m)


def test_where_torchs_orders_differ_it_is_listed():
    # m == p: Megatron runs every forward first; PyTorch keeps its 1F1B steady state
    assert compare_with_torch(make_schedule("interleaved", 4, 4)).startswith("rank 2 from action 7")
    # DualPipeV's whole backward and overlapped F&B, run as B then W and as F then backward
    assert from_torch_actions("dualpipev", [["0F0", "0B0"]], 1).stages == ((Action("F", 0), Action("B", 0)),)
    overlapped = [["0F0", "1F0", "1I0", "0F1", "0B0", "1W0", "1F1", "1B1", "0B1"]]
    got = from_torch_actions("dualpipev", overlapped, 2, (0, 0))
    assert " ".join(map(str, got.stages[0])) == "F0s0 F0s1 B0s1 F1s0 B0s0 W0s0 W0s1 F1s1 B1s1 W1s1 B1s0 W1s0"


def test_quick_split_backward_benchmark_prints_costs_and_both_schedules(capsys):
    assert bench_main(["split_backward", "--quick"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Split backward on ")
    assert "| MLP, 4 x (Linear + Tanh) | 32 | " in out and "| GPT-2, 2 blocks | 32 | " in out
    for p in (2, 4):
        for how in ("simulated |", "simulated, a core per stage |", "measured (gloo processes, ", "measured (Pipe threads, "):
            assert f"| 32 | {p} | {how}" in out
    assert ("| 32 | 4 | simulated, 2 cores shared |" in out) == ((os.cpu_count() or 1) < 4)
