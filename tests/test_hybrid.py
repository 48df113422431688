"""Tests for parallel_lib.hybrid: data parallel over pipelines equals one process.

Starting four ranks costs seconds, so one launch runs every layout in turn (2 x 2
with both schedules, pure PP 1 x 4, pure DP 4 x 1) and then a deliberately broken
run whose ranks disagree on the micro-batch count, to see every wait time out with
a message that names the rank.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from parallel_lib.hybrid import (
    HEAD_COPY,
    HybridConfig,
    compare_with_reference,
    gather_state,
    run_hybrid,
    run_hybrid_many,
    summarize,
)
from parallel_lib.pipeline_parallel import make_schedule
from parallel_lib.pipeline_parallel.link import StageLink, exchange_plan, find_deadlock
from parallel_lib.planner import p2p_bytes
from parallel_lib.runtime import launch
from parallel_lib.training import RunConfig, global_batches, reference

# SGD with a large step: unlike Adam, its update is proportional to the gradient, so a
# wrong loss normalisation or a gradient summed instead of averaged changes the parameters
BASE = HybridConfig(dp=2, pp=2, micro_batches=2, batch_size=8, steps=2, train_examples=64, vocab_size=300,
                    max_length=16, optimizer="sgd", lr=0.5, return_state=True)
LAYOUTS = {
    "2x2 1f1b": replace(BASE, timeline_step=1),
    "2x2 gpipe": replace(BASE, schedule="gpipe", micro_batches=3, batch_size=12, steps=2),
    "1x4 1f1b": replace(BASE, dp=1, pp=4, micro_batches=4),
    "4x1": replace(BASE, dp=4, pp=1, micro_batches=1),
}
BROKEN_TIMEOUT = 2.0


def layouts_then_broken_run(rank: int, world_size: int, configs: list[HybridConfig]) -> tuple[list, str]:
    """Every layout, then a 2 x 2 run in which rank 0 stops after one step and the others wait for it."""
    results = run_hybrid_many(rank, world_size, configs)
    broken = replace(BASE, return_state=False, timeout=BROKEN_TIMEOUT, steps=1 if rank == 0 else 2)
    try:
        run_hybrid(rank, world_size, broken)
        message = "no error"
    except (TimeoutError, RuntimeError) as error:
        message = f"{type(error).__name__}: {error}"
    time.sleep(BROKEN_TIMEOUT + 1)  # leave the default group only after every peer has given up
    return results, message


@pytest.fixture(scope="module")
def launched() -> tuple[dict[str, list], list[str]]:
    per_rank = launch(layouts_then_broken_run, 4, list(LAYOUTS.values()), threads_per_rank=1, timeout=240)
    by_layout = {name: [results[k] for results, _ in per_rank] for k, name in enumerate(LAYOUTS)}
    return by_layout, [message for _, message in per_rank]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_parameters_and_losses_equal_one_process_on_the_global_batches(launched, name):
    results = launched[0][name]
    config = LAYOUTS[name]
    run = RunConfig(**config.one_process_fields())
    losses, expected = reference(run, dp=config.dp)
    differences = compare_with_reference(results, expected)
    assert set(differences) == set(expected)  # every parameter lives on some stage, the head's copy too
    assert max(differences.values()) < 1e-5, {k: v for k, v in differences.items() if v >= 1e-5}
    summary = summarize(results)
    tokens = [int(b["label_token_weights"].sum()) for b in global_batches(run, config.dp)]
    assert results[0].tokens == tokens  # the replicas' batches make up the global batch
    assert summary["losses"] == pytest.approx(losses, rel=1e-5)


def test_bytes_sent_are_what_the_planner_counts(launched):
    for name, results in launched[0].items():
        config = LAYOUTS[name]
        boundary = config.batch_size // config.dp * config.max_length * 64 * 4  # tiny: n_embd 64, fp32
        for r in results:  # forward to the next stage, gradients back to the previous one
            assert r.bytes_p2p == boundary * ((r.stage > 0) + (r.stage < config.pp - 1)), (name, r.rank)
        assert summarize(results)["bytes_p2p"] == p2p_bytes(boundary, config.pp), name
        # every gradient of a replica, the head's copy included, goes through its dp all-reduce once
        replica = [r for r in results if r.replica == 0]
        expected = 4 * sum(r.num_parameters for r in replica) if config.dp > 1 else 0
        assert sum(r.bytes_dp for r in replica) == expected, name
        assert all((r.bytes_tied > 0) == (config.pp > 1 and r.stage in (0, config.pp - 1)) for r in results)


def test_1f1b_holds_fewer_micro_batches_than_gpipe(launched):
    by_layout = launched[0]
    assert [r.peak_activations for r in by_layout["1x4 1f1b"]] == [4, 3, 2, 1]
    assert {r.peak_activations for r in by_layout["2x2 gpipe"]} == {3}


def test_timeline_of_the_traced_step_has_every_action_and_both_all_reduces(launched):
    results = launched[0]["2x2 1f1b"]
    for r in results:
        kinds = sorted((e.kind, e.label) for e in r.events)
        assert kinds.count(("forward", "")) == kinds.count(("backward", "")) == 2, r.rank
        assert ("comm", "dp") in kinds and ("comm", "tied") in kinds
        assert len({e.lane for e in r.events}) == 1
    assert all(not r.events for r in launched[0]["2x2 gpipe"])  # timeline_step=None records nothing


def test_a_wait_that_never_ends_times_out_naming_the_rank_and_the_peer(launched):
    messages = launched[1]
    assert messages[0] == "no error"  # rank 0 trained its one step and left
    assert messages[1].startswith("TimeoutError: rank 1 (replica 0, stage 1) waiting for the activations of "
                                  "micro-batch 0 from rank 0: nothing within timeout=2 s"), messages[1]
    assert messages[2].startswith("TimeoutError: rank 2 (replica 1, stage 0): token count of step 1") or \
        messages[2].startswith("RuntimeError: rank 2 (replica 1, stage 0): token count of step 1: failed"), messages[2]
    assert messages[3].startswith("TimeoutError: rank 3 (replica 1, stage 1) waiting for the activations of "
                                  "micro-batch 0 from rank 2"), messages[3]


@pytest.mark.parametrize("change, match", [
    (dict(dp=3), r"dp \* pp must equal world_size=4, got dp=3 x pp=2 = 6"),
    (dict(dp=1, pp=4, model="nope"), "model must be one of"),
    (dict(dp=1, pp=4, model="tiny", micro_batches=0), "micro_batches must be >= 1"),
    (dict(schedule="zigzag"), "schedule must be one of"),
    (dict(batch_size=9), "batch_size must split into dp=2"),
    (dict(micro_batches=5), "at least micro_batches=5 rows"),
    (dict(steps=9), "need train_examples >= 72"),
    (dict(optimizer="lion"), "optimizer must be 'adamw' or 'sgd'"),
    (dict(timeout=0), "timeout > 0"),
])
def test_config_check_names_the_field(change, match):
    with pytest.raises(ValueError, match=match):
        replace(BASE, **change).check(world_size=4)
    with pytest.raises(ValueError, match=r"pp must be <= the model's 4 blocks"):
        replace(BASE, dp=1, pp=5).check()


def test_gather_state_needs_returned_parameters(launched):
    results = launched[0]["2x2 1f1b"]
    assert HEAD_COPY in gather_state(results, replica=1)
    with pytest.raises(ValueError, match="return_state=True"):
        gather_state([replace(r, state=None) for r in results])
    with pytest.raises(ValueError, match="no stage holds"):
        compare_with_reference([r for r in results if r.stage == 0], gather_state(results))


def test_run_hybrid_needs_a_process_group():
    with pytest.raises(RuntimeError, match="initialised process group"):
        run_hybrid(0, 4, BASE)


# ---- point-to-point built for NCCL: paired exchanges, no tags, 64 MB messages ----

BIG = 64 * 2**20 // 4  # float32 values in one 64 MB message (a 124M GPT-2 activation is ~25 MB)
P2P = replace(BASE, dp=1, pp=2, micro_batches=2, steps=1, return_state=False)


def _value(message):
    return float(message.micro_batch + 1) * (1 if message.kind == "activation" else -1)


def p2p_calls_then_big_exchanges(rank, world_size):
    """Record every batch_isend_irecv of a hybrid step; then a 1F1B exchange plan with 64 MB tensors."""
    batches = []
    original = dist.batch_isend_irecv

    def recording(ops):
        batches.append([("send" if op.op is dist.isend else "recv", op.peer, op.tag) for op in ops])
        return original(ops)

    dist.batch_isend_irecv = recording
    try:
        run_hybrid(rank, world_size, P2P)
    finally:
        dist.batch_isend_irecv = original
    schedule = make_schedule("1f1b", 2, 2)
    group = dist.new_group([0, 1])
    link = StageLink(None if rank == 0 else 0, 1 if rank == 0 else None, f"rank {rank}", 60.0, torch.device("cpu"),
                     group=group)
    received = []
    for e in exchange_plan(schedule, rank):
        got = link.exchange([(m, torch.full((BIG,), _value(m))) for m in e.sends], e.recvs,
                            lambda m: ((BIG,), torch.float32))
        received += [(m, t[0].item(), t[-1].item()) for m, t in zip(e.recvs, got)]
    return batches, received, link.bytes_sent


@pytest.fixture(scope="module")
def p2p_launched():
    return launch(p2p_calls_then_big_exchanges, 2, threads_per_rank=1, timeout=240)


def test_every_pipeline_exchange_is_one_batch_isend_irecv_without_tags(p2p_launched):
    schedule = make_schedule(P2P.schedule, P2P.pp, P2P.micro_batches)
    for rank, (batches, _, _) in enumerate(p2p_launched):
        peer = 1 - rank
        expected = [[("recv", peer, 0)] * len(e.recvs) + [("send", peer, 0)] * len(e.sends)
                    for e in exchange_plan(schedule, rank)]
        assert batches == expected, rank  # the old code posted isend/irecv one by one, tagged


def test_64_mb_messages_arrive_in_order_through_a_1f1b_exchange_plan(p2p_launched):
    for rank, (_, received, sent) in enumerate(p2p_launched):
        assert received and all(first == last == _value(m) for m, first, last in received), rank
        assert sent == 2 * BIG * 4  # two 64 MB messages each way


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
def test_paired_exchanges_complete_under_nccl_rules(name, p, m):
    assert find_deadlock(make_schedule(name, p, m)) is None


@pytest.mark.parametrize("p, m", [(2, 2), (3, 4), (4, 8)])
def test_unpaired_sends_deadlock_1f1b_under_nccl_rules(p, m):
    """What the hybrid 1F1B did before: neighbours both sending, each waiting for the other's receive."""
    verdict = find_deadlock(make_schedule("1f1b", p, m), paired=False)
    assert verdict is not None and verdict.startswith("deadlock: stage 0 waits in [send activation")
    assert find_deadlock(make_schedule("gpipe", p, m), paired=False) is None  # all sends, then all receives


def test_a_message_matched_with_the_wrong_micro_batch_is_found():
    from parallel_lib.pipeline_parallel import Action, Schedule
    F, B = (lambda i: Action("F", i)), (lambda i: Action("B", i))
    swapped = Schedule("swapped", 2, 2, ((F(0), F(1), B(0), B(1)), (F(1), F(0), B(0), B(1))))
    assert "is matched with" in find_deadlock(swapped)


def test_bucketed_all_reduce_takes_a_group_or_a_custom_all_reduce_not_both():
    from torch import nn

    from parallel_lib.data_parallel import BucketedAllReduce
    with pytest.raises(ValueError, match="give all_reduce or group, not both"):
        BucketedAllReduce(nn.Linear(2, 2), all_reduce=lambda t: None, group=object())


def test_a_stage_rank_moves_and_keeps_only_its_stage():
    """GPU item 4: the replica is cut on the CPU and only the stage reaches the rank's device (here the meta
    device, whose copies are counted); nothing else of the replica stays alive on the host. The old code moved
    the whole replica to the device before cutting it."""
    from _census import Moved, live_parameters

    from parallel_lib.hybrid.dp_pp import _stage_of_replica
    config = replace(BASE, dp=1, pp=2)
    for j in range(2):
        host_before = live_parameters("cpu")
        with Moved() as moved:
            module, tied, _, _, _ = _stage_of_replica(config, j, torch.device("meta"))
        held = sum(t.numel() for t in [*module.parameters(), *module.buffers()])
        assert moved.numel == held, j  # the device got the stage's tensors, nothing more
        assert live_parameters("cpu") == host_before, j  # and the host kept nothing of the other stage
        assert all(p.device.type == "meta" for p in module.parameters()) and len(tied) == 1
        del module, tied
