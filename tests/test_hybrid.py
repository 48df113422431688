"""Chapter 05: data parallelism over pipelines, as plans of the one training entry, equals one process.

Starting four ranks costs seconds, so one launch runs every layout in turn (2 x 2 with both
schedules, pure PP 1 x 4, pure DP 4 x 1, all on the course's corpus as chapter 01's
``partition_dataset`` hands it to the replicas) and then a deliberately broken run whose rank 0
stops after one step, to see every wait time out with a message that names the rank.

AdamW with eps = 1e-3 (as test_training_3d): its update then depends on the gradient's scale, so
a wrong loss normalisation, a gradient summed instead of averaged over dp or a tied copy left
unsummed changes the parameters (``test_a_wrong_gradient_scale_would_be_caught``).
(GPU item 4, a stage rank holding only its stage: test_training_3d's
``test_a_pipeline_rank_holds_only_its_stage_of_the_tp_shard`` runs this pure-PP case.)
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from parallel_lib.pipeline_parallel import make_schedule
from parallel_lib.pipeline_parallel.link import StageLink, exchange_plan, find_deadlock
from parallel_lib.planner import p2p_bytes
from parallel_lib.runtime import launch
from parallel_lib.runtime.guard import unwrap
from parallel_lib.training import (Plan, RunConfig, global_batches, job_record, max_difference, reference,
                                   summarize_layout, train, train_many)
from parallel_lib.training.layouts import split_fields
from parallel_lib.training.run import check_layout

RUN = RunConfig(data="corpus", vocab_size=300, seq_len=32, batch_size=8, steps=2, train_examples=64, lr=1e-2,
                eps=1e-3, return_state=True)
BASE = Plan(dp=2, pp=2, micro_batches=2)
LAYOUTS = {
    "2x2 1f1b": (BASE, replace(RUN, timeline_steps=1)),
    "2x2 gpipe": (replace(BASE, schedule="gpipe", micro_batches=3), replace(RUN, batch_size=12)),
    "1x4 1f1b": (Plan(pp=4, micro_batches=4), RUN),
    "4x1": (Plan(dp=4, micro_batches=1), RUN),
}
TOLERANCE = 1e-5  # float sums in another order; a gradient of the wrong scale moves far more (test below)
BROKEN_TIMEOUT = 2.0


def layouts_then_broken_run(rank: int, world_size: int, jobs: list[tuple[Plan, RunConfig]]) -> tuple[list, str]:
    """Every layout, then a 2 x 2 run in which rank 0 stops after one step and the others wait for it."""
    results = train_many(rank, world_size, jobs)
    broken = replace(RUN, return_state=False, timeout=BROKEN_TIMEOUT, steps=1 if rank == 0 else 2)
    try:
        train(rank, world_size, BASE, broken)
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


@pytest.fixture(scope="module")
def expected() -> dict[str, tuple[list[float], dict[str, torch.Tensor]]]:
    return {name: reference(run, dp=plan.dp) for name, (plan, run) in LAYOUTS.items()}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_parameters_and_losses_equal_one_process_on_the_global_batches(launched, expected, name):
    results, (plan, run) = launched[0][name], LAYOUTS[name]
    losses, state = expected[name]
    differences = max_difference(results, state)
    # every parameter lives on some stage, the last stage's copy of the tied embedding (the head) too
    trainable = {k for k in state if not k.endswith((".attn.bias", "masked_bias"))}
    assert set(differences) == (trainable if plan.pp > 1 else trainable - {"lm_head.weight"})
    assert max(differences.values()) < TOLERANCE, {k: v for k, v in differences.items() if v >= TOLERANCE}
    job = job_record(results)
    # the replicas' batches make up the global batch: its target tokens, counted on every rank
    assert job.tokens == [int(b["label_token_weights"].sum()) for b in global_batches(run, plan.dp)]
    assert job.losses == pytest.approx(losses, rel=1e-5)


def test_a_wrong_gradient_scale_would_be_caught(expected):
    """AdamW with gradients twice too large is AdamW with the true gradients and half the eps: one process with
    half the eps is a run whose replicas forgot to divide by dp. It ends far outside the tolerance."""
    plan, run = LAYOUTS["2x2 1f1b"]
    _, state = expected["2x2 1f1b"]
    _, doubled = reference(replace(run, eps=run.eps / 2), dp=plan.dp)
    assert max((doubled[k] - state[k]).abs().max().item() for k in state) > 10 * TOLERANCE


def _sent(r, axis: str, kind: str) -> int:
    return r.traffic[axis].get(kind, (0, 0))[1]


def test_bytes_sent_are_what_the_planner_counts(launched):
    for name, results in launched[0].items():
        plan, run = LAYOUTS[name]
        boundary = run.batch_size // plan.dp * run.seq_len * 64 * 4  # one replica batch, tiny: n_embd 64, fp32
        for r in results:  # forward to the next stage, gradients back to the previous one
            j = r.coords["pp"]
            assert _sent(r, "pp", "send") == r.wire["pp"] == boundary * ((j > 0) + (j < plan.pp - 1)), (name, r.rank)
        assert summarize_layout(results, warmup=0).traffic["pp"] == p2p_bytes(boundary, plan.pp), name
        # every gradient of a replica, the head's copy included, goes through its dp all-reduce once
        replica = [r for r in results if r.coords["dp"] == 0]
        expected = sum(r.parameter_bytes for r in replica) if plan.dp > 1 else 0
        assert sum(_sent(r, "dp", "all_reduce") for r in replica) == expected, name
        assert all((_sent(r, "tied", "all_reduce") > 0) == (plan.pp > 1 and r.coords["pp"] in (0, plan.pp - 1))
                   for r in results), name


def test_1f1b_holds_fewer_micro_batches_than_gpipe(launched):
    by_layout = launched[0]
    assert [r.peak_micro_batches for r in by_layout["1x4 1f1b"]] == [4, 3, 2, 1]
    assert {r.peak_micro_batches for r in by_layout["2x2 gpipe"]} == {3}


def test_timeline_of_the_traced_step_has_every_action_and_both_all_reduces(launched):
    results = launched[0]["2x2 1f1b"]
    for r in results:
        kinds = sorted((e.kind, e.label) for e in r.events)
        assert kinds.count(("forward", "")) == kinds.count(("backward", "")) == 2, r.rank
        assert ("comm", "dp") in kinds and ("comm", "tied") in kinds
        assert len({e.lane for e in r.events}) == 1
    assert all(not r.events for r in launched[0]["2x2 gpipe"])  # timeline_steps=0 records nothing


def test_a_wait_that_never_ends_times_out_naming_the_rank_and_the_peer(launched):
    messages = launched[1]
    assert messages[0] == "no error"  # rank 0 trained its one step and left
    assert messages[1].startswith("TimeoutError: rank 1 (replica 0, stage 1, slice 0) waiting for the activations "
                                  "of micro-batch 0 from rank 0: nothing within timeout=2 s"), messages[1]
    assert messages[2].startswith("RuntimeError: rank 2 (replica 1, stage 0, slice 0): the gradients' mean over the "
                                  "stage's dp group"), messages[2]
    assert messages[3].startswith("RuntimeError: rank 3 (replica 1, stage 1, slice 0): the gradients' mean over the "
                                  "stage's dp group"), messages[3]


@pytest.mark.parametrize("change, match", [
    (dict(dp=3), r"dp \* tp \* pp must equal world_size=4, got 3 x 1 x 2 = 6"),
    (dict(dp=1, pp=4, model="nope"), "model"),
    (dict(dp=1, pp=4, micro_batches=0), "micro_batches"),
    (dict(schedule="zigzag"), "schedule"),
    (dict(batch_size=9), "batch_size must split into dp=2 replicas of micro_batches=2"),
    (dict(micro_batches=5), "micro_batches=5 equal micro-batches"),
    (dict(vocab_size=200), "the corpus tokenizer needs vocab_size >= 258"),
    (dict(timeout=0), "timeout"),
])
def test_a_layout_check_names_the_field(change, match):
    plan_fields, run_fields = split_fields(**change)
    with pytest.raises(ValueError, match=match):
        check_layout(replace(BASE, **plan_fields), replace(RUN, **run_fields), world_size=4)
    with pytest.raises(ValueError, match=r"pp must be <= the model's 4 blocks"):
        check_layout(Plan(pp=5), RUN)


def test_max_difference_needs_returned_parameters(launched, expected):
    results = launched[0]["2x2 1f1b"]
    assert "lm_head.weight" in {k for r in results if r.coords["dp"] == 1 for k in r.state}  # the head's copy
    with pytest.raises(ValueError, match="return_state=True"):
        max_difference([replace(r, state={}) for r in results], {})
    _, state = expected["2x2 1f1b"]
    with pytest.raises(ValueError, match="no stage returned"):
        max_difference([r for r in results if r.coords["pp"] == 0], state)


def test_the_job_record_needs_every_last_stage_rank(launched):
    results = launched[0]["2x2 1f1b"]
    assert job_record(results).step_times == [max(r.record.step_times[k] for r in results) for k in range(2)]
    with pytest.raises(ValueError, match="needs every rank's result: got 1 of the 2 last-stage ranks"):
        job_record([r for r in results if r.rank != 3])


def test_train_needs_a_process_group():
    with pytest.raises(RuntimeError, match="initialised process group"):
        train(0, 4, BASE, RUN)


# ---- point-to-point built for NCCL: paired exchanges, no tags, 64 MB messages ----

BIG = 64 * 2**20 // 4  # float32 values in one 64 MB message (a 124M GPT-2 activation is ~25 MB)
P2P = (Plan(pp=2, micro_batches=2), replace(RUN, steps=1, return_state=False))


def _value(message):
    return float(message.micro_batch + 1) * (1 if message.kind == "activation" else -1)


def p2p_calls_then_big_exchanges(rank, world_size):
    """Record every batch_isend_irecv of a DP × PP step of the one entry; then a 1F1B exchange plan with 64 MB
    tensors."""
    batches = []
    original = dist.batch_isend_irecv

    def recording(ops):
        # unwrap: inside a step the collective counter's stand-in of isend is installed (equal to, not isend)
        batches.append([("send" if unwrap(op.op) is unwrap(dist.isend) else "recv", op.peer, op.tag) for op in ops])
        return original(ops)

    dist.batch_isend_irecv = recording
    try:
        train(rank, world_size, *P2P)
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
    plan = P2P[0]
    schedule = make_schedule(plan.schedule, plan.pp, plan.micro_batches)
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
    """What chapter 05's 1F1B did before: neighbours both sending, each waiting for the other's receive."""
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
