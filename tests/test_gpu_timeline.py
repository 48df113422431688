"""GPU timelines keep the overlap they show: checked on the CPU with fake CUDA events and streams.

A timer that synchronised the device between operations would pass every CPU test and
then, on a GPU, serialise what it times: a prefetched all-gather would look serial and
every bucket's all-reduce would end after backward. Here the code under test runs on
CPU tensors (a one-rank gloo group) while its recorder times a fake ``cuda:0``
(:mod:`_fake_cuda`): the tests assert that nothing synchronises during the step, that
each stamp is an event on the stream that did the work (compute: the current stream; the
end of an asynchronous collective: a side stream that waited for that collective only),
and that the resolved timeline keeps the order and overlap those events encode.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _fake_cuda import install

from parallel_lib.common import TimelineRecorder, max_concurrency

GPU = torch.device("cuda", 0)
VOCAB = 97


class _LoggedWork:
    """A collective's work that logs the (fake) current stream each ``wait`` runs on."""

    def __init__(self, work, log):
        self.work, self.log = work, log

    def wait(self, *args, **kwargs):
        self.log.append(torch.cuda.current_stream(GPU).name)
        return self.work.wait(*args, **kwargs)

    def get_future(self):
        return self.work.get_future()


def _log_waits(monkeypatch, module, *names):
    """Wrap ``module.<name>`` collectives so that their async works log where they are waited on."""
    waits = []
    for name in names:
        real = getattr(module, name)

        def logged(*args, real=real, **kwargs):
            work = real(*args, **kwargs)
            return _LoggedWork(work, waits) if work is not None else None

        monkeypatch.setattr(module, name, logged)
    return waits


def _batch():
    ids = torch.arange(8).reshape(2, 4) % VOCAB
    return dict(input_ids=ids, labels=ids)


def test_stamp_done_ends_on_a_side_stream_that_waited_for_the_work_alone(monkeypatch):
    cuda = install(monkeypatch)
    cuda.times = [100.0]  # the zero event
    recorder = TimelineRecorder(device=GPU)
    waits = []
    work = _LoggedWork(type("Done", (), {"wait": lambda self: None})(), waits)
    # compute from 101 to 102 on the default stream; a collective issued at 101.5 that ran until 103
    cuda.times = [101.0, 101.5, 103.0, 102.0]
    compute_start = recorder.stamp()
    comm_start = recorder.stamp()
    comm_end = recorder.stamp_done(work)
    compute_end = recorder.stamp()
    assert waits == ["side 0"] and torch.cuda.current_stream(GPU).name == "default"  # the compute stream never waited
    assert [e.stream.name for e in cuda.events] == ["default", "default", "default", "side 0", "default"]
    recorder.add_stamped("rank 0 compute", "backward", 0, compute_start, compute_end)
    recorder.add_stamped("rank 0 comm", "comm", 0, comm_start, comm_end)
    assert cuda.synchronized == ["cuda:0"]  # the zero, taken before the step
    offset = recorder._zero_events[GPU][1]  # host seconds at the zero event
    events = recorder.events
    assert [(e.lane, e.start - offset, e.end - offset) for e in events] == [
        ("rank 0 compute", pytest.approx(1.0), pytest.approx(2.0)),
        ("rank 0 comm", pytest.approx(1.5), pytest.approx(3.0))]
    assert max_concurrency(events) == 2  # the collective overlapped the compute, as the events say
    assert cuda.synchronized == ["cuda:0", "cuda:0"]  # once more, when the events were read
    assert recorder.stamp_done(None) is None  # a blocking collective: the caller stamps after it


def test_stamp_done_on_a_cpu_leaves_the_end_to_the_caller():
    assert TimelineRecorder().stamp_done(object()) is None  # nothing waited for: gloo's own completion dates it


def test_a_ddp_bucketed_step_on_a_gpu_synchronises_nothing_and_buckets_end_during_backward(
        monkeypatch, one_rank_group):
    from parallel_lib.common import build_gpt2
    from parallel_lib.data_parallel import BucketedAllReduce

    cuda = install(monkeypatch)
    waits = _log_waits(monkeypatch, dist, "all_reduce")
    model = build_gpt2("tiny", vocab_size=VOCAB, seed=0)
    recorder = TimelineRecorder(device=GPU)
    with BucketedAllReduce(model, bucket_cap_mb=0.05, overlap=True, recorder=recorder) as sync:
        with recorder.record("rank 0", "backward", 0):
            model(**_batch()).loss.backward()
        sync.synchronize()
        assert cuda.synchronized == ["cuda:0"]  # the zero, before the step; nothing during it
        n = len(sync.buckets)
        assert n > 1
        # each bucket: waited on once by a side stream at launch (its end stamp), once by synchronize()
        assert waits == ["side 0"] * n + ["default"] * n
        assert len(cuda.on_stream("side 0")) == n  # the ends
        assert len(cuda.on_stream("default")) == 1 + 2 + n  # the zero, backward's two stamps, the starts
        events = recorder.events
    backward = next(e for e in events if e.kind == "backward")
    comm = [e for e in events if e.kind == "comm"]
    assert [e.label for e in sorted(comm, key=lambda e: e.label)] == sorted(f"b{i}" for i in range(n))
    assert all(e.end <= backward.end for e in comm), "a bucket ended after backward: it waited for the compute"
    assert max_concurrency(events) == 2


def test_a_zero3_prefetch_step_on_a_gpu_synchronises_nothing_and_gathers_overlap_compute(
        monkeypatch, one_rank_group):
    from parallel_lib.common import build_gpt2
    from parallel_lib.sharding import ZeroEngine

    cuda = install(monkeypatch)
    recorder = TimelineRecorder(device=GPU)
    engine = ZeroEngine(build_gpt2("tiny", vocab_size=VOCAB), stage=3, prefetch=True, recorder=recorder)
    waits = _log_waits(monkeypatch, dist, *[name for name in ("all_gather_single", "all_gather_into_tensor",
                                                               "reduce_scatter_single", "reduce_scatter_tensor")
                                           if hasattr(dist, name)])
    engine.model(**_batch()).loss.backward()
    engine.step()
    assert cuda.synchronized == ["cuda:0"]  # the zero, before the step; nothing during it
    assert "side 0" in waits and set(waits) <= {"side 0", "default"}
    assert cuda.on_stream("side 0"), "no asynchronous collective was stamped where it ran"
    events = recorder.events
    assert cuda.synchronized == ["cuda:0", "cuda:0"]  # once more, when the events were read
    forward = {e.label: e for e in events if e.kind == "forward"}
    gathers = [e for e in events if e.label.startswith("AG layer") and e.micro_batch == 0]
    layers = sorted(name for name in forward if name.startswith("layer"))
    assert len(layers) > 1
    for previous, layer in zip(layers, layers[1:]):
        prefetched = next(e for e in gathers if e.label == f"AG {layer}")  # the forward's gather comes first
        # issued before the previous layer computed, and done by the time that compute ended
        assert prefetched.start <= forward[previous].start and prefetched.end <= forward[previous].end
    assert max_concurrency(events) == 2
    engine.remove()


def test_a_data_parallel_step_on_a_gpu_reads_its_phases_from_events_after_the_step(monkeypatch, one_rank_group):
    import parallel_lib.training.run as run_module
    from parallel_lib.training import PHASES, Plan, RunConfig, train

    cuda = install(monkeypatch)
    recorders = []
    monkeypatch.setattr(run_module, "TimelineRecorder", lambda device: recorders.append(TimelineRecorder(device=GPU))
                        or recorders[-1])
    steps = 2
    run = RunConfig(data="corpus", model="tiny", batch_size=6, steps=steps, train_examples=90, vocab_size=300,
                    seq_len=32, optimizer="sgd", lr=0.5, bucket_cap_mb=0.05, timeline_steps=1)
    result = train(0, 1, Plan(sync="bucketed", micro_batches=1), run)
    # the zero when the recorder is made and reset before training, the events' read after it: none in a step
    assert cuda.synchronized == ["cuda:0"] * 3
    # data, compute, sync and optimizer: five stamps a step on the compute stream, each read after its step
    # by waiting for that event alone
    phase_stamps = [e for e in cuda.event_waits if e.stream.name == "default"]
    assert len(phase_stamps) == 5 * steps
    phases = result.record.phases
    assert set(phases) == set(PHASES) and all(len(v) == steps and min(v) >= 0 for v in phases.values())
    assert len(result.record.step_times) == steps and min(result.record.step_times) > 0
    comm = [e for e in result.events if e.lane == "rank 0 comm"]  # the buckets
    backward = next(e for e in result.events if e.kind == "backward")
    assert len(comm) > 1 and all(e.end <= backward.end for e in comm)  # the buckets overlapped backward
