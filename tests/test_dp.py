"""Chapter 01 on the one training entry: every gradient averager (``Plan.sync``) equals one process.

``train(rank, world, Plan(dp=N, sync=...), RunConfig(data="corpus", ...))`` trains N replicas on
the course's corpus, each loading its ``partition_dataset`` part of every global batch; one
process (:func:`parallel_lib.training.reference`, Part I's plain loop) trains on the global
batches. One launch per world size runs every sync in turn (ranks cost seconds to start, a
three-step run of the tiny model a fraction of one).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from parallel_lib.runtime import launch
from parallel_lib.training import (
    AVERAGERS,
    PHASES,
    Plan,
    RunConfig,
    global_batches,
    job_record,
    reference,
    replica_rows,
    train,
    train_layout,
    train_many,
)

# SGD, not Adam: Adam's update hardly depends on the gradient's scale, so it would hide a
# wrong loss normalisation; 0.05 MB buckets: several buckets for the tiny model
SMALL = RunConfig(data="corpus", model="tiny", batch_size=6, steps=3, train_examples=90, vocab_size=300, seq_len=32,
                  optimizer="sgd", lr=0.5, bucket_cap_mb=0.05)
SYNCED = ("naive", "bucketed", "ring", "ddp")


def dp_plan(world_size: int, sync: str) -> Plan:
    """Chapter 01's layout: ``world_size`` replicas, one forward and backward per step."""
    return Plan(dp=world_size, sync=sync, micro_batches=1)


def _assert_states_close(actual: dict, expected: dict, what: str) -> None:
    for name, tensor in actual.items():
        torch.testing.assert_close(tensor, expected[name], rtol=1e-5, atol=1e-6, msg=f"{what}: {name}")


def _max_difference(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module", params=[2, 3])
def launched(request):
    """(world_size, run, {sync: [TrainResult per rank]}) for every sync, one launch."""
    world_size = request.param
    # 3 ranks: 12 examples make 2 steps an epoch, so that the corpus's reshuffle per epoch is compared too
    run = SMALL if world_size == 2 else replace(SMALL, train_examples=12, steps=4)
    jobs = {sync: (dp_plan(world_size, sync), run) for sync in AVERAGERS}
    # and one traced run: forward/backward/comm events of the first step, with small buckets
    jobs["traced"] = (dp_plan(world_size, "bucketed"), replace(run, timeline_steps=1, bucket_cap_mb=0.02,
                                                               return_state=False))
    results = launch(train_many, world_size, list(jobs.values()), timeout=240, startup_timeout=240)
    return world_size, run, {name: [r[i] for r in results] for i, name in enumerate(jobs)}


def test_every_averager_is_a_sync_of_the_one_entry():
    from parallel_lib.training import SYNCS

    assert set(AVERAGERS) == {"naive", "bucketed", "ring", "ddp", "none"} and set(AVERAGERS) < set(SYNCS)


def test_data_parallel_equals_single_process_on_the_global_batch(launched):
    world_size, run, by_sync = launched
    losses, expected = reference(run, dp=world_size)
    batches = global_batches(run, world_size)
    tokens = [int(b["label_token_weights"].sum()) for b in batches]
    for sync in SYNCED:
        results = by_sync[sync]
        for result in results:
            _assert_states_close(result.state, expected, f"{sync}, rank {result.rank} of {world_size}")
            assert result.state.keys() == results[0].state.keys()
            assert all(torch.equal(t, results[0].state[n]) for n, t in result.state.items()), f"{sync}: ranks differ"
        job = job_record(results)
        assert job.tokens == tokens  # the replicas' rows add up to the global batch
        assert job.losses == pytest.approx(losses, rel=1e-4)
    # replicas held different token counts, so a mean of per-replica means would not have matched
    assert any(len({int(replica_rows(b, d, world_size)["label_token_weights"].sum()) for d in range(world_size)}) > 1
               for b in batches)


def test_without_gradient_sync_replicas_drift_apart(launched):
    world_size, run, by_sync = launched
    results = by_sync["none"]
    assert all(_max_difference(results[0].state, r.state) > 1e-3 for r in results[1:])  # every replica its own
    synced = by_sync["bucketed"][0].state
    assert _max_difference(results[0].state, synced) > 1e-3


def test_result_records_steps_and_phases(launched):
    world_size, run, by_sync = launched
    results = by_sync["bucketed"]
    result = results[0]
    assert result.record.steps == job_record(results).steps == run.steps
    assert set(result.record.phases) == set(PHASES) == {"data", "compute", "sync", "optimizer", "gc"}
    assert all(len(v) == run.steps and min(v) >= 0 for v in result.record.phases.values())
    for k in range(run.steps):  # a step is timed from its rows on the device to its optimizer step; gc overlaps
        assert sum(result.record.phases[p][k] for p in ("compute", "sync", "optimizer")) == pytest.approx(
            result.record.step_times[k])
    job = job_record(results)
    assert job.step_times == [max(r.record.step_times[k] for r in results) for k in range(run.steps)]
    assert job.throughput(skip=1) > 0


def test_timeline_records_bucket_all_reduces_during_backward(launched):
    world_size, run, by_sync = launched
    for result in by_sync["traced"]:
        lane = f"rank {result.rank}"
        kinds = [(e.lane, e.kind) for e in result.events]
        assert kinds[:2] == [(lane, "forward"), (lane, "backward")]
        comm = [e for e in result.events if e.lane == f"{lane} comm"]  # the buckets (the step's "dp" wait: on lane)
        backward = result.events[1]
        assert len(comm) > 1 and {e.kind for e in comm} == {"comm"}
        assert [e.label for e in comm] == [f"b{i}" for i in range(len(comm))]
        assert min(e.start for e in comm) < backward.end  # the first bucket left before backward ended
        # only the first step: its forward, backward and buckets, and one wait for the dp mean (no micro-batch)
        assert all(e.micro_batch == 0 for e in result.events if e.lane != lane or e.kind != "comm")
        assert [e.label for e in result.events if e.lane == lane and e.kind == "comm"] == ["dp"]


@pytest.mark.parametrize("plan, run, match", [
    (Plan(dp=2, sync="allreduce", micro_batches=1), SMALL, "sync must be one of"),
    (Plan(dp=2, sync="naive", zero=1, micro_batches=1), SMALL, "zero=1"),
    (Plan(dp=1, tp=2, sync="naive", micro_batches=1), SMALL, "tp=1"),
    (Plan(dp=1, pp=2, sync="ring", micro_batches=1), SMALL, "pp=1"),
    (Plan(dp=2, sync="bucketed"), replace(SMALL, batch_size=8), "micro_batches=1"),
    (Plan(dp=2, sync="zero", micro_batches=1), SMALL, "optimizer='adamw'"),
    (dp_plan(2, "naive"), replace(SMALL, optimizer="lamb"), "optimizer"),
    (dp_plan(2, "naive"), replace(SMALL, batch_size=0), "batch_size"),
    (dp_plan(2, "naive"), replace(SMALL, seq_len=4096), "seq_len"),
    (dp_plan(2, "bucketed"), replace(SMALL, bucket_cap_mb=0.0), "bucket_cap_mb"),
])
def test_a_run_that_cannot_work_is_refused_by_name_before_any_rank_starts(plan, run, match):
    with pytest.raises(ValueError, match=match):
        train_layout(plan, run)


def test_train_without_a_process_group_fails_clearly():
    with pytest.raises(RuntimeError, match="train needs an initialised process group"):
        train(0, 1, dp_plan(1, "naive"), SMALL)


def test_the_reference_is_part_one_s_loop(monkeypatch):
    """One single-process loop in the library: the reference's steps are common.training.train's."""
    import parallel_lib.training.one_process as one_process

    calls = []
    plain = one_process.train
    monkeypatch.setattr(one_process, "train", lambda *a, **k: calls.append(1) or plain(*a, **k))
    losses, _ = reference(replace(SMALL, steps=1))
    assert calls == [1] and len(losses) == 1


def test_the_default_model_is_the_same_on_every_device():
    # one stated default: the one-process reference builds the same model on the CPU
    assert RunConfig().model == "tiny"
    with pytest.raises(ValueError, match=r"model must be one of \['gpt2', 'small', 'tiny'\], got model=None"):
        RunConfig(model=None).check()


def test_drift_per_module_and_the_pictures(launched):
    import matplotlib.pyplot as plt

    from parallel_lib.viz.dp import (
        parameter_drift,
        render_breakdown,
        render_drift,
        render_partitions,
        render_throughput,
    )

    world_size, run, by_sync = launched
    drift = parameter_drift([r.state for r in by_sync["none"]])
    assert set(drift) == {"transformer.wte", "transformer.wpe", "transformer.ln_f"} | {
        f"transformer.h.{i}" for i in range(4)}
    assert min(drift.values()) > 0 and max(parameter_drift([r.state for r in by_sync["ddp"]]).values()) == 0
    for fig in (render_drift({"none": drift}), render_breakdown(by_sync["bucketed"][0]),
                render_throughput({"run": (by_sync["bucketed"], 2)}), render_partitions(10, world_size, 2 * world_size)):
        assert fig.axes
        plt.close(fig)


TINY_RUN = ["--world-size", "1", "--batch-size", "4", "--train-examples", "40", "--vocab-size", "300",
            "--seq-len", "32", "--sync", "naive"]


def test_command_line_trains_saves_the_run_and_says_when_it_is_all_warm_up(capsys, tmp_path):
    from parallel_lib.data_parallel.cli import main

    assert main(TINY_RUN + ["--steps", "2", "--save", str(tmp_path / "run.pt")]) == 0
    out = capsys.readouterr().out
    assert "sync=naive" in out and "ranks_identical True" in out and f"saved to        {tmp_path}" in out
    # the summary skips 2 warm-up steps by default: no throughput to report, and it says so
    assert "tokens_per_sec  not measured: the run has 2 steps and the first 2 are warm-up; run more than 2" in out
    assert "nan" not in out
    saved = torch.load(tmp_path / "run.pt")
    assert saved["rank"] == 0 and saved["world_size"] == 1 and len(saved["losses"]) == 2
    assert saved["config"]["sync"] == "naive" and saved["summary"]["steps"] == 2
    checksum = sum(tensor.double().sum() for tensor in saved["state"].values())  # the tied head is not in it
    assert "lm_head.weight" not in saved["state"]
    assert float(checksum) == pytest.approx(saved["checksums"][0], rel=1e-9)


def test_every_clock_read_of_a_rank_waits_for_its_own_device(monkeypatch, one_rank_group):
    """The phases and the timeline are the rank's recorder's stamps (CUDA events on a GPU, read after
    the step: tests/test_gpu_timeline.py); on a CPU, host clock reads. Given a logged wait for the rank's
    device, the log shows every clock read of a step after it, and no raw read in run.py."""
    import gc

    import parallel_lib.common.timeline as timeline
    import parallel_lib.training.phases as phases
    import parallel_lib.training.run as run_module
    from _timing import assert_clock_reads_follow_syncs, record_clock_reads

    log = record_clock_reads(monkeypatch)
    recorder = run_module.TimelineRecorder
    monkeypatch.setattr(run_module, "TimelineRecorder", lambda device: recorder(
        lambda: timeline.synchronize_devices([device]), device=device))
    raw_reads = []  # perf_counter read outside the recorder (only the GC clock may)
    monkeypatch.setattr(phases, "time", type("Time", (), {"perf_counter": staticmethod(
        lambda: raw_reads.append(1) or 0.0)}))
    gc.disable()  # the GC clock reads the host clock when a collection runs: none during this test
    try:
        result = train(0, 1, dp_plan(1, "none"), replace(SMALL, steps=2, timeline_steps=1))
    finally:
        gc.enable()
    reads = assert_clock_reads_follow_syncs(log, ("cpu",))  # the rank's device, and only it
    assert reads >= 5 * 2, "the five phase stamps of each step"
    assert raw_reads == []
    assert [e.kind for e in result.events] == ["forward", "backward"]
