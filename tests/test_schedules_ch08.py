"""Chapter 08's schedules as data: generators, validator, hang gallery and simulator.

Bubble convention (parallel_lib.pipeline_parallel.simulator): idle inside a rank's own span
relative to its work, max over ranks; chapter 04's (p-1)/(m+p-1) is b / (1 + b).
"""

import pytest

from parallel_lib.common import idle_fraction
from parallel_lib.pipeline_parallel import (
    Action,
    bubble_fraction,
    check_blocking,
    hang_gallery,
    in_flight,
    make_schedule,
    parse_schedule,
    simulate,
    simulate_schedule,
    stages_per_rank,
    validate_schedule,
)
from parallel_lib.common.timeline import Event
from parallel_lib.pipeline_parallel.simulator import peak_in_flight
from parallel_lib.pipeline_parallel.timeline_stats import dispatch_overheads

NEW = ["interleaved", "zb-h1", "zb-h2", "zbv", "dualpipev"]
PS = range(1, 9)
MS = range(1, 17)


def valid_sizes(name):
    return [(p, m) for p in PS for m in MS if (name != "interleaved" or m % p == 0) and (name != "dualpipev" or m >= 2 * p)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b", *NEW])
def test_every_schedule_is_valid_for_p_up_to_8_and_every_valid_m(name):
    for p, m in valid_sizes(name):
        schedule = make_schedule(name, p, m)
        validate_schedule(schedule)
        assert schedule.num_model_stages == p * stages_per_rank(name)
        if name in ("gpipe", "1f1b", "zb-h1", "zb-h2"):  # one stage per rank: NCCL's blocking rules hold too
            check_blocking(schedule, sender_order=False)


def test_interleaved_states_and_checks_its_requirement_on_m():
    with pytest.raises(ValueError, match="multiple of p=4.*got m=6"):
        make_schedule("interleaved", 4, 6)
    with pytest.raises(ValueError, match="multiple of p=4.*got m=2"):
        make_schedule("interleaved", 4, 2)
    with pytest.raises(ValueError, match="dualpipev needs m.*at least 2p=8.*got m=7"):
        make_schedule("dualpipev", 4, 7)


def test_interleaved_warm_up_is_megatrons():
    p, m, v = 4, 8, 2
    schedule = make_schedule("interleaved", p, m)
    for r, actions in enumerate(schedule.stages):
        first_b = next(k for k, a in enumerate(actions) if a.kind == "B")
        assert first_b == (p - r - 1) * 2 + (v - 1) * p + 1  # warm-up forwards, then one steady forward
        assert {a.stage for a in actions} == {r, r + p}  # stage s on rank s % p


def test_zb_h1_puts_off_the_first_r_weight_gradients_on_rank_r():
    assert [" ".join(map(str, a)) for a in make_schedule("zb-h1", 2, 3).stages] == [
        "F0 F1 B0 W0 F2 B1 W1 B2 W2",
        "F0 B0 F1 B1 W0 F2 B2 W1 W2",
    ]


@pytest.mark.parametrize("p, m", [(p, m) for p in PS for m in MS])
def test_closed_form_bubbles_are_exact_for_equal_costs(p, m):
    one = simulate_schedule(make_schedule("1f1b", p, m), (1.0, 2.0))
    assert one.bubble == pytest.approx((p - 1) / m)
    b = one.bubble  # chapter 04's convention: the same idle time as a share of the whole step
    assert b / (1 + b) == pytest.approx(bubble_fraction(p, m))
    assert idle_fraction(one.events) == pytest.approx(bubble_fraction(p, m))
    zb = simulate_schedule(make_schedule("zb-h1", p, m), (1.0, 1.0, 1.0))
    if m >= p:  # fewer micro-batches leave too few W to fill the cool-down
        assert zb.bubble == pytest.approx((p - 1) / (3 * m))
    if m % p == 0:
        inter = simulate_schedule(make_schedule("interleaved", p, m), (1.0, 2.0))
        assert inter.bubble == pytest.approx((p - 1) / (2 * m))
    if m >= 2 * p - 1:  # enough micro-batches for the extra warm-up: no rank idles inside its span
        h2 = simulate_schedule(make_schedule("zb-h2", p, m), (1.0, 1.0, 1.0))
        assert h2.bubble == pytest.approx(0.0)
        assert h2.sync_bubble == pytest.approx((p - 1) / (3 * m))  # the parallelogram's ends, one step alone
    if m >= 2 * p - 1:  # ZB-V: no idle inside any rank's span; its parallelogram is made of half stages
        v = simulate_schedule(make_schedule("zbv", p, m), (1.0, 1.0, 1.0))
        assert v.bubble == pytest.approx(0.0)
        assert v.sync_bubble == pytest.approx((p - 1) / (6 * m))
    if m >= 2 * p:  # DualPipeV without credit for its overlap: ZB-V's step, the idle time inside every span
        dual = simulate_schedule(make_schedule("dualpipev", p, m), (1.0, 1.0, 1.0))
        assert dual.bubble == pytest.approx((p - 1) / (6 * m))
        assert dual.step_time == pytest.approx(v.step_time)


@pytest.mark.parametrize("p, m", [(p, m) for p in PS for m in MS])
def test_peak_in_flight_activations_match_each_schedules_published_figure(p, m):
    assert peak_in_flight(make_schedule("gpipe", p, m)) == [m] * p
    assert peak_in_flight(make_schedule("1f1b", p, m)) == [min(p - r, m) for r in range(p)]
    assert peak_in_flight(make_schedule("zb-h1", p, m)) == [min(p, m)] * p  # 1F1B's peak, on every rank
    assert peak_in_flight(make_schedule("zb-h2", p, m)) == [min(2 * p - 1, m)] * p  # about twice
    # ZB-V: 1F1B's activation memory (2p half-stages = p micro-batches, README of the ZB repository),
    # on every rank once m fills the V; fewer micro-batches hold less
    zbv = peak_in_flight(make_schedule("zbv", p, m))
    assert zbv == [p] * p if m >= 2 * p - 1 else max(zbv) <= p
    if m >= 2 * p:  # DualPipe: PP + 1 chunks (DeepSeek-V3 report, table 2), PP = 2p half-stages in the V
        assert peak_in_flight(make_schedule("dualpipev", p, m)) == [(2 * p + 1) / 2] * p
    if m % p == 0:  # Megatron: warm-up + 1 stage-activations of 1/v each
        want = [(2 * m if m == p else min((p - r - 1) * 2 + p + 1, 2 * m)) / 2 for r in range(p)]
        assert peak_in_flight(make_schedule("interleaved", p, m)) == want


def test_simulated_memory_matches_the_list_reading():
    result = simulate_schedule(make_schedule("zb-h1", 4, 8), (1.0, 1.0, 1.0), activation_bytes=1000)
    assert result.peak_bytes == [4000.0] * 4
    # in_flight reads the same memory off the timeline, W releasing
    peak = [max(in_flight(result.events, t + 0.5)[r] for t in range(int(result.step_time))) for r in range(4)]
    assert peak == [4, 4, 4, 4]


def test_hang_gallery_rejects_every_exhibit_with_its_reason():
    exhibits = hang_gallery()
    reasons = [e.reason for e in exhibits]
    assert len(exhibits) == 6
    assert "multiple of p=4" in reasons[0]
    assert "must run each of" in reasons[1]
    assert "activation 0 is matched with activation 1" in reasons[2]
    assert reasons[3].startswith("schedule '1f1b' hangs with blocking messages (one send or receive at a time)")
    assert "is matched with gradient" in reasons[4]
    assert "deadlocks" in reasons[5]
    validate_schedule(exhibits[3].schedule)  # the eager-buffer one is fine by dependencies alone


def test_validator_names_the_rule_a_split_backward_breaks():
    validate_schedule(parse_schedule("ok", "F0 B0 W0", "F0 B0 W0"))
    with pytest.raises(ValueError, match="stage 1 runs W0 before B0"):
        validate_schedule(parse_schedule("w first", "F0 B0 W0", "F0 W0 B0"))
    with pytest.raises(ValueError, match="stage 1 must run each of"):  # a split backward everywhere or nowhere
        validate_schedule(parse_schedule("half", "F0 B0 W0", "F0 B0"))


def test_simulator_costs_w_and_communication():
    schedule = make_schedule("1f1b", 4, 8)
    assert simulate_schedule(schedule, (1.0, 2.0)).step_time == 8 * 3 + 3 * 3
    # the first micro-batch crosses p-1 links forward and p-1 back before rank 0's first B; in the
    # steady state each F/B pair waits for a round trip too, so comm costs more than 2(p-1)c
    assert simulate_schedule(schedule, (1.0, 2.0), 0.5).step_time > 8 * 3 + 3 * (3 + 2 * 0.5)
    events = simulate(make_schedule("zb-h1", 2, 2), (1.0, 2.0, 3.0))
    assert sorted({(e.label, e.duration) for e in events}) == [("", 1.0), ("", 2.0), ("W", 3.0)]
    unsplit = simulate(make_schedule("1f1b", 2, 2), (1.0, 2.0, 3.0))  # B runs B + W
    assert {e.duration for e in unsplit if e.kind == "backward"} == {5.0}


@pytest.mark.parametrize("name", ["gpipe", "1f1b", *NEW])
def test_shared_cores_replay_equals_the_list_scheduler_when_every_rank_has_a_core(name):
    for p, m in [(2, 4), (3, 6), (4, 8)]:
        schedule = make_schedule(name, p, m)
        costs = (1.0, 1.5, 0.7) if schedule.split_backward else (1.0, 2.2)
        own = sorted((e.lane, e.label, e.micro_batch, e.start, e.end) for e in simulate(schedule, costs, 0.3))
        for cores in (p, p + 3):
            shared = simulate(schedule, costs, 0.3, cores=cores)
            assert sorted((e.lane, e.label, e.micro_batch, round(e.start, 9), round(e.end, 9)) for e in shared) == \
                [(lane, label, i, round(start, 9), round(end, 9)) for lane, label, i, start, end in own]


@pytest.mark.parametrize("name", ["gpipe", "1f1b", *NEW])
def test_one_shared_core_is_never_idle_while_work_is_ready(name):
    schedule = make_schedule(name, 4, 8)
    costs = (1.0, 1.5, 0.7) if schedule.split_backward else (1.0, 2.2)
    work = 8 * 4 * (1.0 + 1.5 + 0.7 if schedule.split_backward else 1.0 + 2.2)
    assert simulate_schedule(schedule, costs, cores=1).step_time == pytest.approx(work)


def test_ranks_sharing_cores_by_hand():
    # GPipe, p = 2, m = 2, F = 1, B = 2, one core: F1 on rank 0 and F0 on rank 1 share it (1 -> 3),
    # so do B0 on rank 1 and B1 on rank 0 (6 -> 10)
    events = simulate(make_schedule("gpipe", 2, 2), (1.0, 2.0), cores=1)
    assert sorted((e.lane, e.kind, e.micro_batch, e.start, e.end) for e in events) == [
        ("stage 0", "backward", 0, 10.0, 12.0), ("stage 0", "backward", 1, 6.0, 10.0),
        ("stage 0", "forward", 0, 0.0, 1.0), ("stage 0", "forward", 1, 1.0, 3.0),
        ("stage 1", "backward", 0, 6.0, 10.0), ("stage 1", "backward", 1, 4.0, 6.0),
        ("stage 1", "forward", 0, 1.0, 3.0), ("stage 1", "forward", 1, 3.0, 4.0)]
    # p = 4, m = 2 on two cores. 1F1B (F = 1, B = 2) never has more than two ranks busy: (m+p-1)(F+B).
    # ZB-H1 (F = B = W = 1): three busy ranks from 7 (W0 on 3, B1 on 2, B0 on 0: end 8.5), four
    # from 8.5 (end 10.5), three from 10.5 (end 12), two from 12 (end 13), against 11 with a core each.
    assert simulate_schedule(make_schedule("1f1b", 4, 2), (1.0, 2.0), cores=2).step_time == 15.0
    assert simulate_schedule(make_schedule("zb-h1", 4, 2), (1.0, 1.0, 1.0), cores=2).step_time == pytest.approx(13.0)
    assert simulate_schedule(make_schedule("zb-h1", 4, 2), (1.0, 1.0, 1.0)).step_time == 11.0
    with pytest.raises(ValueError, match="cores"):
        simulate(make_schedule("1f1b", 2, 2), cores=0)


def test_actions_name_their_stage_and_reject_unknown_kinds():
    assert str(Action("W", 3, 5)) == "W3s5"
    with pytest.raises(ValueError, match="kind must be 'F', 'B' or 'W'"):
        Action("X", 0)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zbv", "dualpipev"])
def test_dispatch_overheads_read_back_the_simulators_communication_time(name):
    schedule = make_schedule(name, 4, 8)
    assert dispatch_overheads(simulate(schedule, (1.0, 2.0, 1.0), comm=0.25), schedule) == (0.0, 0.25)


def test_dispatch_overheads_of_a_measured_timeline():
    lane0, lane1 = "stage 0", "stage 1"
    events = [Event(lane0, "forward", 0, 0.0, 1.0), Event(lane0, "forward", 1, 1.1, 2.1),  # a gap of 0.1
              Event(lane1, "forward", 0, 1.5, 2.5), Event(lane1, "backward", 0, 2.8, 3.8),  # the loss's B: 0.3
              Event(lane1, "forward", 1, 3.8, 4.8),  # F1 arrived while rank 1 was busy: not counted
              Event(lane0, "backward", 0, 4.2, 5.2),  # waited 0.4 for rank 1's B0
              Event(lane1, "backward", 1, 4.8, 5.8), Event(lane0, "backward", 1, 6.4, 7.4)]  # waited 0.6
    assert dispatch_overheads(events, make_schedule("1f1b", 2, 2)) == pytest.approx((0.1, 0.5))
