"""The process engine: one gloo rank per pipeline rank runs every schedule and computes the unsplit
model's loss and gradients, every message inside one batch_isend_irecv on the pipeline group; the
schedules check_blocking refuses paired are the ones that exchange in rounds."""

import threading

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn

from parallel_lib.pipeline_parallel import check_blocking, make_schedule
from parallel_lib.pipeline_parallel.link import find_deadlock, plan_exchanges, round_plans
from parallel_lib.pipeline_parallel.process import ProcessConfig, mlp_and_batch, run_pipeline_ranks
from parallel_lib.runtime.launcher import launch

ALL = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zbv", "dualpipev"]
NEEDS_ROUNDS = {"interleaved", "zbv", "dualpipev"}


def only_batched_p2p(rank, world_size, configs):
    """``run_pipeline_ranks`` with bare send/recv/isend/irecv failing; records every batch's (op, dtype, group)."""
    inside, batches = threading.local(), []
    original_batch = dist.batch_isend_irecv
    originals = {name: getattr(c10d, name) for name in ("isend", "irecv", "send", "recv")}

    def guarded(name):
        def call(*args, **kwargs):
            if not getattr(inside, "batch", False):
                raise AssertionError(f"bare dist.{name} outside batch_isend_irecv")
            return originals[name](*args, **kwargs)
        return call

    def batch(ops):
        batches.append([("send" if op.op is dist.isend else "recv", op.tensor.dtype, op.group is None
                         or op.group == dist.GroupMember.WORLD) for op in ops])
        inside.batch = True
        try:
            return original_batch(ops)
        finally:
            inside.batch = False

    wrappers = {name: guarded(name) for name in originals}
    for name, wrapper in wrappers.items():
        setattr(c10d, name, wrapper)
        setattr(dist, name, wrapper)
    dist.batch_isend_irecv = batch
    try:
        return run_pipeline_ranks(rank, world_size, configs), batches
    finally:
        for name, original in originals.items():
            setattr(c10d, name, original)
            setattr(dist, name, original)
        dist.batch_isend_irecv = original_batch


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8)])
def test_every_schedule_over_processes_matches_one_process(p, m):
    configs = [ProcessConfig(schedule=name, micro_batches=m, timeout=30) for name in ALL]
    launched = launch(only_batched_p2p, p, configs, backend="gloo", timeout=120)
    results = [r for r, _ in launched]
    for k, config in enumerate(configs):
        model, x, y = mlp_and_batch(config)
        expected = nn.functional.mse_loss(model(x), y)
        expected.backward()
        loss = sum(results[r][k]["loss"] for r in range(p))
        grads = {name: g for r in range(p) for name, g in results[r][k]["grads"].items()}
        assert loss == pytest.approx(expected.item(), rel=1e-6), config.schedule
        assert sorted(grads) == sorted(name for name, _ in model.named_parameters())
        for name, param in model.named_parameters():
            torch.testing.assert_close(grads[name], param.grad, msg=f"{config.schedule}: {name}")
    for _, batches in launched:  # every message went through a batch on the pipeline group, never the default one
        assert batches and not any(default for ops in batches for _, _, default in ops)


def test_receive_buffers_take_the_senders_dtype_and_bare_p2p_never_runs():
    """A bf16 model's activations and gradients arrive as bf16 (the old engine allocated float32 buffers)."""
    configs = [ProcessConfig(schedule=name, micro_batches=4, dtype="bfloat16", timeout=30)
               for name in ("1f1b", "zbv")]
    launched = launch(only_batched_p2p, 2, configs, backend="gloo", timeout=120)
    for rank, (_, batches) in enumerate(launched):
        dtypes = {dtype for ops in batches for _, dtype, _ in ops}
        assert dtypes == {torch.bfloat16}, rank
    for k, config in enumerate(configs):
        model, x, y = mlp_and_batch(config)
        expected = nn.functional.mse_loss(model(x).float(), y.float()).item()
        loss = sum(launched[r][0][k]["loss"] for r in range(2))
        assert loss == pytest.approx(expected, rel=2e-2), config.schedule
        assert all(g.dtype == torch.bfloat16 for r in range(2) for g in launched[r][0][k]["grads"].values())


@pytest.mark.parametrize("name", ALL)
def test_the_schedules_that_exchange_in_rounds_are_the_ones_check_blocking_refuses(name):
    schedule = make_schedule(name, 4, 8)
    try:
        check_blocking(schedule)
        refused = False
    except ValueError:
        refused = True
    assert refused == (name in NEEDS_ROUNDS)
    plans = plan_exchanges(schedule)  # what the runtime runs: accepted under NCCL's blocking rule
    assert find_deadlock(schedule, plans=plans) is None
    assert (plans == round_plans(schedule)) == (name in NEEDS_ROUNDS)


@pytest.mark.parametrize("name", ["interleaved", "zbv", "dualpipev"])
@pytest.mark.parametrize("p, m", [(2, 4), (3, 6), (4, 8), (4, 12)])
def test_rounds_complete_under_nccl_rules_where_pairing_deadlocks(name, p, m):
    schedule = make_schedule(name, p, m)
    assert find_deadlock(schedule, sender_order=True) is not None or m == p  # paired: a deadlock or a mismatch
    assert find_deadlock(schedule, plans=round_plans(schedule)) is None


def test_a_zero_bubble_w_runs_outside_the_exchanges_around_it():
    # ZB-H1's last rank of two: F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3. Gradient 1 goes out with the
    # receive of activation 2 before W0 (not alone, with activation 2's receive after W0, which made
    # the first rank wait through W0 for its send of activation 2 to be taken)
    schedule = make_schedule("zb-h1", 2, 4)
    from parallel_lib.pipeline_parallel.link import exchange_plan
    assert [(e.before, str(e)) for e in exchange_plan(schedule, 1)] == [
        (0, "[receive activation 0]"), (2, "[send gradient 0 | receive activation 1]"),
        (4, "[send gradient 1 | receive activation 2]"), (7, "[send gradient 2 | receive activation 3]"),
        (10, "[send gradient 3]")]
    for p, m in ((2, 8), (4, 8), (4, 16)):  # so W adds no exchange: every rank exchanges as often as in 1F1B
        plans = plan_exchanges(make_schedule("zb-h1", p, m))
        assert [len(plan) for plan in plans] == [len(plan) for plan in plan_exchanges(make_schedule("1f1b", p, m))]


def test_a_schedule_no_plan_runs_is_refused_naming_why():
    from parallel_lib.pipeline_parallel import parse_schedule
    cycle = parse_schedule("waits for itself", "F0 B0 F1 B1", "F0 F1 B1 B0")
    with pytest.raises(ValueError, match="schedule 'waits for itself' stalls: no rank can run its next action"):
        plan_exchanges(cycle)


def test_a_stage_link_needs_the_pipeline_group_and_refuses_a_tensor_unlike_its_spec():
    from parallel_lib.pipeline_parallel.link import Message, StageLink
    with pytest.raises(ValueError, match="group must be the pipeline's process group .* got None"):
        StageLink(None, 1, "rank 0", 1.0, torch.device("cpu"), group=None)
    link = StageLink(None, 1, "rank 0", 1.0, torch.device("cpu"), group=object())
    with pytest.raises(ValueError, match=r"as torch.float32 \(2, 3\), but rank 1 expects torch.bfloat16 \(2, 3\)"):
        link.exchange([(Message("activation", 0), torch.zeros(2, 3))], [], lambda m: ((2, 3), torch.bfloat16))


@pytest.mark.parametrize("fields, match", [
    (dict(rows=2, micro_batches=4), "rows=2 cannot fill micro_batches=4"),  # #22 item 10: reported a NaN loss
    (dict(micro_batches=0), "micro_batches must be an int >= 1"),
    (dict(blocks=2.0), r"blocks must be an int >= 1, got blocks=2.0 \(float\)"),
    (dict(width=True), "width must be an int >= 1, got width=True"),
    (dict(timeout=0), "timeout must be > 0"),
    (dict(dtype="float16"), "dtype must be one of"),
])
def test_a_config_that_cannot_run_is_refused_when_made(fields, match):
    with pytest.raises(ValueError, match=match):
        ProcessConfig(**fields)
