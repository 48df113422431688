import matplotlib
import pytest
from _timing import assert_clock_reads_follow_syncs, record_clock_reads

matplotlib.use("Agg")

from parallel_lib.common import (
    DeviceClock,
    Event,
    TimelineRecorder,
    busy_time,
    idle_fraction,
    lanes,
    makespan,
    max_concurrency,
    synchronize_devices,
)
from parallel_lib.viz.timeline import plot_timeline  # noqa: E402


def gpipe_like(m=3, p=2):
    """Unit-cost GPipe forward: micro-batch i on stage j during tick [i+j, i+j+1)."""
    return [Event(f"stage {j}", "forward", i, i + j, i + j + 1) for i in range(m) for j in range(p)]


def test_idle_fraction_of_ideal_gpipe_is_the_bubble_formula():
    for m, p in [(1, 1), (3, 2), (4, 4), (8, 3)]:
        assert idle_fraction(gpipe_like(m, p)) == pytest.approx((p - 1) / (m + p - 1))


def test_concurrency_busy_and_span():
    events = gpipe_like(3, 2)
    assert lanes(events) == ["stage 0", "stage 1"]
    assert makespan(events) == 4
    assert busy_time(events, "stage 1") == 3
    assert max_concurrency(events) == 2
    sequential = [Event("a", "forward", 0, 0, 1), Event("b", "forward", 0, 1, 2), Event("a", "backward", 0, 2, 3)]
    assert max_concurrency(sequential) == 1


def test_tolerance_ignores_touching_hand_overs():
    jittered = [Event("a", "forward", 0, 0.0, 1.001), Event("b", "forward", 0, 1.0, 2.0)]
    assert max_concurrency(jittered) == 2
    assert max_concurrency(jittered, tolerance=0.01) == 1


def test_overlapping_events_on_one_lane_count_once():
    events = [Event("a", "comm", None, 0, 2), Event("a", "forward", 0, 1, 3)]
    assert busy_time(events, "a") == 3


def test_recorder_times_blocks_even_when_they_raise():
    rec = TimelineRecorder()
    with rec.record("cpu", "forward", 0, label="block 0"):
        pass
    with pytest.raises(KeyError):
        with rec.record("cpu", "backward", 0):
            raise KeyError("boom")
    assert [(e.kind, e.label) for e in rec.events] == [("forward", "block 0"), ("backward", "")]
    assert all(e.end >= e.start >= 0 for e in rec.events)
    rec.reset()
    assert rec.events == []


def test_recorder_calls_synchronize_before_each_stamp():
    calls = []
    rec = TimelineRecorder(synchronize=lambda: calls.append(1))
    assert len(calls) == 1  # the zero, too, is taken once the device is idle
    with rec.record("cuda:0", "forward"):
        pass
    assert len(calls) == 3
    rec.reset()
    assert len(calls) == 4


def test_device_clock_waits_on_its_devices_only_then_reads_the_clock(monkeypatch):
    import torch

    log = record_clock_reads(monkeypatch)
    clock = DeviceClock([torch.device("cuda:1"), torch.device("cpu"), torch.device("cuda:1")])
    first, second = clock(), clock()
    assert second >= first
    assert assert_clock_reads_follow_syncs(log, ("cuda:1", "cpu")) == 2
    assert repr(clock) == "DeviceClock(['cuda:1', 'cpu'])"


@pytest.mark.parametrize("kwargs, match", [(dict(kind="idle"), "kind must be one of"),
                                           (dict(start=2.0, end=1.0), "end must not precede start")])
def test_bad_events(kwargs, match):
    fields = dict(lane="a", kind="forward", micro_batch=0, start=0.0, end=1.0) | kwargs
    with pytest.raises(ValueError, match=match):
        Event(**fields)


def test_plot_draws_one_bar_per_event_and_reports_the_bubble():
    events = gpipe_like(3, 2)
    fig = plot_timeline(events, title="GPipe", unit="ticks")
    ax = fig.axes[0]
    assert len(ax.patches) == len(events)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["stage 0", "stage 1"]
    assert "idle 25%" in ax.get_title()
    with pytest.raises(ValueError, match="unit"):
        plot_timeline(events, unit="minutes")


def test_synchronize_devices_waits_on_each_cuda_device_once(monkeypatch):
    import torch

    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(str(device)))
    synchronize_devices([torch.device("cpu"), torch.device("cuda:1"), torch.device("cuda:0"), torch.device("cuda:1")])
    assert waited == ["cuda:1", "cuda:0"]  # named devices, not just the current one; CPUs skipped


def test_cuda_event_stamps_are_recorded_on_each_devices_stream_and_resolved_once(monkeypatch):
    import torch
    from _fake_cuda import install

    cuda = install(monkeypatch)
    gpus = [torch.device("cuda:0"), torch.device("cuda:1")]
    rec = TimelineRecorder(event_devices=[*gpus, torch.device("cpu"), gpus[0]])
    assert rec.event_devices == gpus  # CPUs and repeats dropped
    assert [str(e.stream.device) for e in cuda.events] == ["cuda:0", "cuda:1"]  # one zero event per GPU
    assert cuda.synchronized == ["cuda:0", "cuda:1"]  # zero taken with every GPU idle
    for k, gpu in enumerate(gpus):
        start = rec.stamp(gpu)
        end = rec.stamp(gpu)
        rec.add_stamped(f"device {k}", "forward", 0, start, end, f"h{k}")
    cpu_start = rec.stamp(torch.device("cpu"))
    assert isinstance(cpu_start, float)  # the host clock, as before
    rec.add_stamped("cpu", "forward", 0, cpu_start, rec.stamp(None), "host")
    assert [e.lane for e in rec._events] == ["cpu"]  # GPU intervals wait for resolve()
    assert len(cuda.recorded_on("cuda:0")) == len(cuda.recorded_on("cuda:1")) == 3
    assert cuda.synchronized == ["cuda:0", "cuda:1"]  # stamping never waits for a device
    events = rec.events  # reading the events after the step resolves them
    assert events is rec.events and cuda.synchronized[2:] == ["cuda:0", "cuda:1"]
    assert sorted(e.lane for e in events) == ["cpu", "device 0", "device 1"]
    assert [e.start for e in events] == sorted(e.start for e in events)
    assert all(0 <= e.start <= e.end for e in events)
    assert rec.resolve() == events  # nothing pending twice
