"""Tests for parallel_lib.data_parallel: data-parallel training equals one process on the global batch.

One launch per world size runs every sync method in turn (ranks cost seconds to
start, a three-step run of the tiny model a fraction of one).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _timing import assert_clock_reads_follow_syncs, record_clock_reads

from parallel_lib.data_parallel import (
    PHASES,
    DPConfig,
    run_dp,
    run_dp_many,
    single_process_reference,
    summarize,
    train_replica,
)
from parallel_lib.data_parallel.cli import main
from parallel_lib.data_parallel.dp import prepare_replica
from parallel_lib.runtime import launch

# SGD, not Adam: Adam's update hardly depends on the gradient's scale, so it would hide a
# wrong loss normalisation; 0.05 MB buckets: several buckets for the tiny model
SMALL = DPConfig(model="tiny", batch_size=6, max_steps=3, train_examples=90, val_examples=16, vocab_size=300,
                 optimizer="sgd", lr=0.5, return_state=True, bucket_cap_mb=0.05)
SYNCED = ("naive", "bucketed", "ring", "ddp")


def _assert_states_close(actual: dict, expected: dict, what: str) -> None:
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, rtol=1e-5, atol=1e-6, msg=f"{what}: {name}")


def _max_difference(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module", params=[2, 3])
def launched(request):
    """(world_size, config, {sync: [DPResult per rank]}) for every sync method, one launch."""
    world_size = request.param
    # 3 ranks: two epochs, so that set_epoch's reshuffle is part of the comparison too
    config = SMALL if world_size == 2 else replace(SMALL, epochs=2, max_steps=2)
    configs = {sync: replace(config, sync=sync) for sync in SYNCED + ("none",)}
    # and one traced run: forward/backward/comm events of the first step, with small buckets
    configs["traced"] = replace(config, sync="bucketed", timeline_steps=1, bucket_cap_mb=0.02, return_state=False)
    results = launch(run_dp_many, world_size, list(configs.values()), timeout=240)
    return world_size, config, {name: [r[i] for r in results] for i, name in enumerate(configs)}


def test_data_parallel_equals_single_process_on_the_global_batch(launched):
    world_size, config, by_sync = launched
    record, expected = single_process_reference(world_size, config)
    for sync in SYNCED:
        results = by_sync[sync]
        for result in results:
            _assert_states_close(result.state, expected, f"{sync}, rank {result.rank} of {world_size}")
        assert len({r.checksum for r in results}) == 1, f"{sync}: ranks differ"
        job = results[0].record
        assert job.tokens == record.tokens  # the ranks' shards add up to the global batch
        assert job.losses == pytest.approx(record.losses, rel=1e-4)
        assert all(r.record.losses == job.losses for r in results)
        assert [sum(r.local.tokens[k] for r in results) for k in range(job.steps)] == job.tokens
    # ranks held different token counts, so a mean of per-rank means would not have matched
    assert any(len({r.local.tokens[k] for r in by_sync["naive"]}) > 1 for k in range(record.steps))


def test_without_gradient_sync_replicas_drift_apart(launched):
    world_size, config, by_sync = launched
    results = by_sync["none"]
    assert len({r.checksum for r in results}) == world_size
    assert _max_difference(results[0].state, results[1].state) > 1e-3
    synced = by_sync["bucketed"][0].state
    assert _max_difference(results[0].state, synced) > 1e-3


def test_result_records_steps_epochs_and_timings(launched):
    world_size, config, by_sync = launched
    result = by_sync["bucketed"][0]
    steps = config.max_steps * config.epochs
    assert result.record.steps == result.local.steps == steps
    assert len(result.epoch_times) == config.epochs
    assert set(result.breakdown) == set(PHASES) == {"data", "compute", "sync", "optimizer", "gc"}
    assert result.breakdown is result.local.phases  # one record: the phases are the local record's
    assert all(len(v) == steps and min(v) >= 0 for v in result.breakdown.values())
    for k in range(steps):  # a step is timed from its batch to its optimizer step; gc overlaps the phases
        assert sum(result.breakdown[p][k] for p in ("compute", "sync", "optimizer")) == pytest.approx(
            result.local.step_times[k])
    summary = summarize(by_sync["bucketed"], warmup=1)
    assert summary["ranks_identical"] and summary["world_size"] == world_size and summary["tokens_per_sec"] > 0
    assert not summarize(by_sync["none"])["ranks_identical"]


def test_timeline_records_bucket_all_reduces_during_backward(launched):
    world_size, config, by_sync = launched
    for result in by_sync["traced"]:
        lane = f"rank {result.rank}"
        kinds = [(e.lane, e.kind) for e in result.events]
        assert kinds[:2] == [(lane, "forward"), (lane, "backward")]
        comm = [e for e in result.events if e.kind == "comm"]
        backward = result.events[1]
        assert len(comm) > 1 and {e.lane for e in comm} == {f"{lane} comm"}
        assert [e.label for e in comm] == [f"b{i}" for i in range(len(comm))]
        assert min(e.start for e in comm) < backward.end  # the first bucket left before backward ended
        assert all(e.micro_batch == 0 for e in result.events)  # only the first step


@pytest.mark.parametrize("field, value", [("sync", "allreduce"), ("optimizer", "lamb"), ("batch_size", 0),
                                          ("max_length", 4096)])
def test_bad_config_is_rejected_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        single_process_reference(1, replace(SMALL, **{field: value}))


def test_run_dp_without_a_process_group_fails_clearly():
    with pytest.raises(RuntimeError, match="run_dp needs an initialised process group"):
        run_dp(0, 1, SMALL)


TINY_RUN = ["--world-size", "1", "--batch-size", "4", "--train-examples", "40", "--vocab-size", "300",
            "--val-examples", "8", "--sync", "naive"]


def test_command_line_trains_saves_the_run_and_says_when_it_is_all_warm_up(capsys, tmp_path):
    assert main(TINY_RUN + ["--max-steps", "2", "--save", str(tmp_path / "run.pt")]) == 0
    out = capsys.readouterr().out
    assert "sync=naive" in out and "ranks_identical True" in out and f"saved to        {tmp_path}" in out
    # the summary skips 2 warm-up steps by default: no throughput to report, and it says so
    assert "tokens_per_sec  not measured: the run has 2 steps and the first 2 are warm-up; run more than 2" in out
    assert "nan" not in out
    saved = torch.load(tmp_path / "run.pt")
    assert saved["rank"] == 0 and saved["world_size"] == 1 and len(saved["losses"]) == 2
    assert saved["config"]["sync"] == "naive" and saved["summary"]["steps"] == 2
    checksum = sum(tensor.double().sum() for name, tensor in saved["state"].items() if name != "lm_head.weight")
    assert float(checksum) == pytest.approx(saved["checksums"][0], rel=1e-9)  # the tied head counted once


def test_every_clock_read_of_a_rank_waits_for_its_own_device(monkeypatch):
    import gc

    import parallel_lib.common.timeline as timeline
    import parallel_lib.data_parallel.dp as dp

    log = record_clock_reads(monkeypatch)
    # the recorder's stamps (phases, timeline) wait for nothing: CUDA events on a GPU, read after the step
    # (tests/test_gpu_timeline.py), the host clock on a CPU; give its host reads a logged wait here, so
    # that the log shows every clock read of the rank and no raw one
    recorder = dp.TimelineRecorder
    monkeypatch.setattr(dp, "TimelineRecorder", lambda device: recorder(
        lambda: timeline.synchronize_devices([device]), device=device))
    raw_reads = []  # perf_counter read in dp.py itself, without a device sync (only the GC clock may)
    monkeypatch.setattr(dp, "time", type("Time", (), {"perf_counter": staticmethod(
        lambda: raw_reads.append(1) or 0.0)}))
    gc.disable()  # the GC clock reads the host clock when a collection runs: none during this test
    try:
        result = train_replica(0, 1, replace(SMALL, sync="none", max_steps=2, timeline_steps=1))
    finally:
        gc.enable()
    reads = assert_clock_reads_follow_syncs(log, ("cpu",))  # the rank's device, and only it
    assert reads >= 5 * 2 + 2, "t0..t4 of each step and the epoch's start and end"
    assert raw_reads == []
    assert [e.kind for e in result.events] == ["forward", "backward"]


def test_drift_per_module_and_the_pictures(launched):
    import matplotlib.pyplot as plt

    from parallel_lib.viz.dp import (
        parameter_drift,
        render_breakdown,
        render_drift,
        render_partitions,
        render_throughput,
    )

    world_size, config, by_sync = launched
    drift = parameter_drift([r.state for r in by_sync["none"]])
    assert set(drift) == {"transformer.wte", "transformer.wpe", "transformer.ln_f", "lm_head.weight"} | {
        f"transformer.h.{i}" for i in range(4)}
    assert min(drift.values()) > 0 and max(parameter_drift([r.state for r in by_sync["ddp"]]).values()) == 0
    for fig in (render_drift({"none": drift}), render_breakdown(by_sync["bucketed"][0]),
                render_throughput({"run": by_sync["bucketed"]}), render_partitions(10, world_size, 2 * world_size)):
        assert fig.axes
        plt.close(fig)


def test_the_default_model_is_the_same_on_every_device():
    # one stated default: the one-process reference builds the same model on the CPU
    assert DPConfig().model == "tiny"
    with pytest.raises(ValueError, match=r"model must be one of \['gpt2', 'small', 'tiny'\], got model=None"):
        prepare_replica(DPConfig(model=None), torch.device("cpu"))
