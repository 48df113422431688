"""Schedules as data: the GPipe wavefront, GPipe and 1F1B action lists, validator, simulator,
and the animation that draws them."""

import matplotlib
import matplotlib.pyplot as plt
import pytest

from parallel_lib.common import Event, idle_fraction, makespan
from parallel_lib.pipeline_parallel import (
    Action,
    Schedule,
    bubble_fraction,
    gpipe,
    in_flight,
    make_schedule,
    one_f_one_b,
    simulate,
    stage_costs_from_events,
    validate_schedule,
)
from parallel_lib.pipeline_parallel.schedule import _clock_cycles
from parallel_lib.viz.schedule import bubble_until, render_schedule, schedule_widget

SIZES = [(m, p) for m in range(1, 9) for p in range(1, 9)]


def as_text(schedule: Schedule) -> list[str]:
    return [" ".join(map(str, actions)) for actions in schedule.stages]


def test_clock_cycles_of_the_classic_three_by_three_example():
    assert list(_clock_cycles(3, 3)) == [
        [(0, 0)],
        [(1, 0), (0, 1)],
        [(2, 0), (1, 1), (0, 2)],
        [(2, 1), (1, 2)],
        [(2, 2)],
    ]


@pytest.mark.parametrize("m, p", SIZES)
def test_clock_cycles_visit_every_pair_once_on_its_diagonal(m, p):
    ticks = list(_clock_cycles(m, p))
    assert len(ticks) == m + p - 1
    pairs = [pair for tick in ticks for pair in tick]
    assert sorted(pairs) == [(i, j) for i in range(m) for j in range(p)]
    for k, tick in enumerate(ticks):
        assert all(i + j == k for i, j in tick), f"tick {k} is off the diagonal: {tick}"
        partitions = [j for _, j in tick]
        assert len(partitions) == len(set(partitions)), f"tick {k} uses a partition twice: {tick}"


def test_gpipe_runs_all_forwards_then_backwards_in_reverse():
    assert as_text(gpipe(2, 3)) == ["F0 F1 F2 B2 B1 B0"] * 2


def test_one_f_one_b_has_warm_up_steady_state_and_cool_down():
    assert as_text(one_f_one_b(4, 6)) == [
        "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5",
        "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5",
        "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5",
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5",
    ]
    # fewer micro-batches than stages: the warm-up is cut short
    assert as_text(one_f_one_b(3, 1)) == ["F0 B0"] * 3


def peak_in_flight(actions):
    """Largest number of micro-batches forwarded but not yet backwarded, along one stage's list."""
    live = peak = 0
    for a in actions:
        live += 1 if a.kind == "F" else -1
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("m, p", SIZES)
def test_generated_schedules_are_valid_and_match_the_bubble_formula(name, m, p):
    schedule = make_schedule(name, p, m)
    validate_schedule(schedule)
    events = simulate(schedule)
    assert makespan(events) == 2 * (m + p - 1)
    assert idle_fraction(events) == pytest.approx(bubble_fraction(p, m))
    peaks = [peak_in_flight(actions) for actions in schedule.stages]
    if name == "gpipe":
        assert peaks == [m] * p
    else:
        assert peaks == [min(p - j, m) for j in range(p)]


def test_simulate_respects_dependencies_and_stage_order():
    schedule = one_f_one_b(3, 4)
    events = simulate(schedule, [(1.0, 2.0), (1.5, 3.0), (1.0, 2.0)])
    at = {(e.lane, e.kind, e.micro_batch): e for e in events}
    for e in events:
        j = int(e.lane.split()[1])
        if e.kind == "forward" and j > 0:
            assert e.start >= at[(f"stage {j - 1}", "forward", e.micro_batch)].end
        if e.kind == "backward":
            assert e.start >= at[(e.lane, "forward", e.micro_batch)].end
            if j < 2:
                assert e.start >= at[(f"stage {j + 1}", "backward", e.micro_batch)].end
    for j, actions in enumerate(schedule.stages):  # each lane runs its actions in list order, never overlapping
        lane = sorted((e for e in events if e.lane == f"stage {j}"), key=lambda e: e.start)
        assert [f"{'F' if e.kind == 'forward' else 'B'}{e.micro_batch}" for e in lane] == list(map(str, actions))
        assert all(a.end <= b.start for a, b in zip(lane, lane[1:]))


def test_forward_only_schedule_is_the_clock_cycle_wavefront():
    events = simulate(gpipe(3, 3).forward_only())
    by_tick = {}
    for e in events:
        by_tick.setdefault(int(e.start), []).append((e.micro_batch, int(e.lane.split()[1])))
    assert [sorted(by_tick[k], key=lambda pair: pair[1]) for k in sorted(by_tick)] == list(_clock_cycles(3, 3))


def test_validator_rejects_broken_schedules():
    def custom(*rows):
        return Schedule("custom", len(rows), 2, tuple(tuple(Action(s[0], int(s[1:])) for s in r.split())
                                                      for r in rows))
    validate_schedule(custom("F0 F1 B0 B1", "F0 B0 F1 B1"))  # in-order backward is legal too
    with pytest.raises(ValueError, match="stage 1 must run each of"):
        validate_schedule(custom("F0 F1 B0 B1", "F0 B0 F1 B1 B1"))
    with pytest.raises(ValueError, match="stage 0 runs B1 before F1"):
        validate_schedule(custom("F0 B1 F1 B0", "F0 F1 B1 B0"))
    with pytest.raises(ValueError, match="deadlocks"):  # stage 0 waits for B1 before sending F1
        validate_schedule(custom("F0 B0 F1 B1", "F0 F1 B1 B0"))


def test_bad_sizes_and_names_are_rejected():
    with pytest.raises(ValueError, match="m must be an int >= 1, got m=0"):
        gpipe(2, 0)
    with pytest.raises(ValueError, match="p must be an int >= 1"):
        one_f_one_b(0, 2)
    with pytest.raises(ValueError, match="schedule must be one of"):
        make_schedule("zero-bubble", 2, 2)
    with pytest.raises(ValueError, match="stage_costs must be"):
        simulate(gpipe(2, 2), [(1.0, 2.0)] * 3)


def test_stage_costs_from_measured_events_feed_the_simulator():
    events = [Event("stage 0", "forward", 0, 0.0, 1.0), Event("stage 0", "forward", 1, 1.0, 4.0),
              Event("stage 0", "backward", 0, 5.0, 7.0)]
    assert stage_costs_from_events(events, 1) == [(2.0, 2.0)]
    with pytest.raises(ValueError, match="no backward events on lane 'stage 1'"):
        stage_costs_from_events(events + [Event("stage 1", "forward", 0, 0, 1)], 2)


def test_in_flight_counts_activations_held_at_a_moment():
    events = simulate(gpipe(2, 3))  # stage 0: F0 F1 F2 at ticks 0-3, B2 B1 B0 at 5-8
    assert in_flight(events, 0) == [0, 0]
    assert in_flight(events, 3) == [3, 2]  # stage 1 runs F2 during [3, 4)
    assert in_flight(events, 6) == [2, 1]
    assert in_flight(events, 8) == [0, 0]


def test_render_schedule_titles_the_bubble_so_far_and_at_the_end():
    matplotlib.use("Agg")
    fig = render_schedule(gpipe(2, 2), tick=2)
    title = fig.axes[0].get_title()
    assert "tick 2/6 · bubble so far 25%, at the end 33%" in title  # 1 idle of 4 stage-ticks so far
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["stage 0 · holds 2", "stage 1 · holds 1"]
    assert "bubble 33% (formula (p−1)/(m+p−1) = 33%)" in render_schedule(gpipe(2, 2)).axes[0].get_title()
    plt.close("all")
    assert bubble_until(simulate(gpipe(2, 2)), 0, 2) == 0.0


def test_schedule_widget_redraws_when_the_tick_or_schedule_changes():
    matplotlib.use("Agg")
    widget = schedule_widget("gpipe", stages=2, micro_batches=2)
    status, tick, choose, stages = widget.children[-2], widget.children[2].children[1], \
        widget.children[0].children[0], widget.children[1].children[0]
    assert tick.max == 6 and "tick 0/6" in status.value
    tick.value = 2
    assert "bubble so far 25%" in status.value and "[2, 1]" in status.value
    choose.value = "1f1b"
    assert "<b>1F1B</b>, tick 2/6" in status.value
    stages.value = 4
    assert tick.max == 10
    plt.close("all")
