"""Chapter 10's 3D run as a plan of the one training entry: DP × TP × PP = 2 × 2 × 2 on 8 gloo ranks.

Every plan must equal one process (the one :func:`~parallel_lib.training.reference`), and every
rank's counted traffic per mesh axis and its tensor census must equal
:mod:`parallel_lib.training.traffic`'s formulas exactly (ZeRO's padded flat groups included).

Starting eight ranks is the slow part (each imports torch and transformers), so ONE launch
runs every plan: 1F1B with plain data parallelism on the course's grid order, GPipe with
recomputation and ZeRO-1 on Megatron's default order, 1F1B with ZeRO-2, GPipe with ZeRO-3 (two
all-gathers and a reduce-scatter per layer group and micro-batch), and 8 replicas with ZeRO-1 on a model whose flat
group needs padding. The model is tiny
GPT-2 narrowed to 32 features, the sequences 8 tokens: the point is the bookkeeping, not the
arithmetic. AdamW with eps = 1e-3 (as in test_layouts): its update then depends on the
gradient's scale, so a gradient summed instead of averaged over dp or a tied copy left unsummed
shows (``test_a_wrong_gradient_scale_would_be_caught``).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from parallel_lib.pipeline_parallel.microbatch import stage_blocks
from parallel_lib.runtime import launch
from parallel_lib.runtime.collectives import ring_wire_bytes
from parallel_lib.sharding.memory import zero_traffic
from parallel_lib.cost.shape import GPTShape
from parallel_lib.tensor_parallel.cost import shard_parameters, step_collectives
from parallel_lib.training import Plan, RunConfig, reference, train_many
from parallel_lib.training.layouts import job_step_times, max_difference, measure_layout, split_fields, \
    summarize_layout
from parallel_lib.training.run import check_layout
from parallel_lib.training.traffic import dp_groups, expected_traffic, owned_parameters, stage_parameters, \
    state_bytes, wire_bytes

RUN = RunConfig(n_layer=4, n_embd=32, vocab_size=64, seq_len=8, batch_size=8, steps=2, lr=1e-2, eps=1e-3,
                return_state=True, timeout=120.0)
BASE = Plan(dp=2, tp=2, pp=2, micro_batches=2, schedule="1f1b", order="tp-pp-dp")
# GPT-2's tensors are multiples of its width, so a width of 32 never pads over 2, 4 or 8 replicas; 3 blocks
# of width 36 over 8 replicas do: 55,044 values -> 55,048, and the padding travels and is stored too
PADDED = RunConfig(n_layer=3, n_embd=36, vocab_size=64, seq_len=8, batch_size=16, steps=2, lr=1e-2, eps=1e-3,
                   return_state=True, timeout=120.0)
CASES = {"1f1b zero0": (BASE, RUN),
         "gpipe recompute zero1 tp-dp-pp": (replace(BASE, schedule="gpipe", recompute=True, zero=1, order="tp-dp-pp"),
                                            RUN),
         "1f1b zero2": (replace(BASE, zero=2), RUN),
         "gpipe zero3": (replace(BASE, zero=3, schedule="gpipe"), RUN),
         "dp8 zero1 padded": (Plan(dp=8, zero=1), PADDED)}
PLANS = {name: plan for name, (plan, _) in CASES.items()}
# float32 sums in another order (all-reduces, micro-batches) differ by ~1e-7 (test_layouts: 2e-7);
# a gradient twice too large moves the parameters by far more (test_a_wrong_gradient_scale_would_be_caught)
TOLERANCE = 1e-6


def shape_of(run: RunConfig) -> GPTShape:
    """The run's model (tiny's 4 heads and 128 positions, narrowed)."""
    return GPTShape(run.shape["n_layer"], run.shape["n_embd"], run.shape["n_head"], run.vocab_size,
                    run.shape["n_positions"])


SHAPE = shape_of(RUN)


@pytest.fixture(scope="module")
def launched() -> dict[str, list]:
    per_rank = launch(train_many, 8, list(CASES.values()), threads_per_rank=1, timeout=300, startup_timeout=300)
    return {name: [results[k] for results in per_rank] for k, name in enumerate(CASES)}


@pytest.fixture(scope="module")
def expected() -> dict[RunConfig, tuple[list[float], dict[str, torch.Tensor]]]:
    return {run: reference(run) for run in {run for _, run in CASES.values()}}


@pytest.mark.parametrize("change, match", [
    (dict(tp=3), "world_size"), (dict(tp=8, dp=1, pp=1), "n_head"), (dict(batch_size=6), "batch_size"),
    (dict(pp=8, dp=1, tp=1), "pp"), (dict(schedule="zb"), "schedule"), (dict(dropout=1.0), "dropout must be below 1"),
    (dict(dropout=-0.1), "dropout")])
def test_a_layout_that_cannot_run_is_refused_before_any_rank_starts(change, match):
    plan_fields, run_fields = split_fields(**change)
    with pytest.raises(ValueError, match=match):
        check_layout(replace(BASE, **plan_fields), replace(RUN, **run_fields), world_size=8)


def test_a_field_of_neither_plan_nor_run_is_named():
    with pytest.raises(TypeError, match="momentum"):
        split_fields(momentum=0.9)


# Worked out by hand for SHAPE (L = 4 blocks, h = 32, V = 64, 128 positions). One block's values on a tp rank:
# ln_1 and ln_2 2h each, c_attn 3h² + 3h and the MLP's c_fc 4h² + 4h split by t, the two projections h² and
# 4h² split with their biases h whole: (12h² + 7h)/t + 6h = 12,512/t + 192, so 12,704 (t = 1), 6,448 (t = 2),
# 3,320 (t = 4). The first stage adds its slice of the token embedding V·h/t = 2,048/t and the positions
# 128·h = 4,096; the last ln_f 2h = 64 and, with pp > 1, its own copy of the embedding slice 2,048/t.
STAGE_PARAMETERS = {
    (1, 1): [57_024],                   # 4 · 12,704 + 2,048 + 4,096 + 64
    (2, 1): [30_976],                   # 4 · 6,448 + 1,024 + 4,096 + 64
    (2, 2): [18_016, 13_984],           # 2 · 6,448 + 1,024 + 4,096 | 2 · 6,448 + 64 + 1,024
    (4, 4): [7_928, 3_320, 3_320, 3_896],  # 3,320 + 512 + 4,096 | 3,320 | 3,320 | 3,320 + 64 + 512
}
# chapter 07's step on a tp > 1 rank, rows = 2 sequences of 8 tokens: activations b·s·h·4 = 2,048 bytes; 4 blocks x
# 4 all-reduces of them (2 forward, 2 backward), the embedding's g and the head's f (2 more), and the loss's 3
# all-reduces of b·s floats (64 bytes): 21 calls, 16 · 2,048 + 2 · 2,048 + 3 · 64 = 37,056 bytes per micro-batch
TP_STEP = {"all_reduce": (21, 37_056)}


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (2, 2), (4, 4)])
def test_stage_formulas_add_up_to_chapter_07s(tp, pp):
    blocks = [len(b) for b in stage_blocks(SHAPE.n_layer, pp)]
    params = [stage_parameters(SHAPE, tp, blocks[j], j == 0, j == pp - 1, pp) for j in range(pp)]
    head_copy = SHAPE.vocab_size * SHAPE.n_embd // tp if pp > 1 else 0
    assert params == STAGE_PARAMETERS[tp, pp]
    assert shard_parameters(SHAPE, tp) + head_copy == sum(STAGE_PARAMETERS[tp, pp])
    # ZeRO's flat groups hold every value of the stage once (dp = 1: no padding)
    for zero in range(4):
        assert [sum(dp_groups(SHAPE, tp, blocks[j], j == 0, j == pp - 1, pp, zero, 1)) for j in range(pp)] == \
            STAGE_PARAMETERS[tp, pp]
    m, rows = 3, 2  # the stages' collectives of m micro-batches are chapter 07's step, m times
    per_stage = [expected_traffic(SHAPE, 1, tp, pp, j, blocks[j], m, rows, 8)["tp"] for j in range(pp)]
    whole = TP_STEP if tp > 1 else {}
    assert step_collectives(SHAPE, rows, 8, tp) == whole
    assert {k: tuple(sum(s[k][i] for s in per_stage) for i in (0, 1)) for k in whole} == \
        {k: (m * c, m * b) for k, (c, b) in whole.items()}
    assert {k for s in per_stage for k in s} == set(whole)  # and no other collective


def test_the_dp_formula_refuses_zero_3_with_recomputation():
    with pytest.raises(ValueError, match="zero=3 with recompute"):
        expected_traffic(SHAPE, 2, 2, 2, 0, 2, 2, 2, 8, recompute=True, zero=3)
    with pytest.raises(ValueError, match="zero"):
        expected_traffic(SHAPE, 2, 2, 2, 0, 2, 2, 2, 8, zero=4)


@pytest.mark.parametrize("name", list(CASES))
def test_parameters_and_losses_equal_one_process(launched, expected, name):
    results, (plan, run) = launched[name], CASES[name]
    losses, state = expected[run]
    differences = max_difference(results, state)
    assert max(differences.values()) < TOLERANCE, sorted(differences.items(), key=lambda kv: -kv[1])[:3]
    if plan.pp > 1:
        assert "lm_head.weight" in differences  # the last stage's copy of the tied embedding, checked too
    last = [r for r in results if r.coords["pp"] == plan.pp - 1 and r.coords["tp"] == 0]
    job = [sum(r.record.losses[k] for r in last) for k in range(run.steps)]
    assert job == pytest.approx(losses, rel=1e-5)


def test_a_wrong_gradient_scale_would_be_caught(expected):
    """AdamW's update m / (sqrt(v) + eps) with gradients twice too large is exactly the update with
    the true gradients and eps / 2: one process with half the eps is a run whose replicas forgot to
    divide by dp. It ends far further from the reference than the 3D runs are allowed to."""
    _, state = expected[RUN]
    _, doubled = reference(replace(RUN, eps=RUN.eps / 2))
    worst = max((doubled[k] - state[k]).abs().max().item() for k in state if not k.endswith(".attn.bias"))
    assert worst > 100 * TOLERANCE, worst


@pytest.mark.parametrize("name", list(CASES))
def test_each_axis_traffic_and_the_census_equal_the_formulas(launched, name):
    (plan, run), shape = CASES[name], shape_of(CASES[name][1])
    rows = run.batch_size // plan.dp // plan.micro_batches
    for r in launched[name]:
        j = r.coords["pp"]
        first, last = j == 0, j == plan.pp - 1
        blocks = len(stage_blocks(shape.n_layer, plan.pp)[j])
        groups = dp_groups(shape, plan.tp, blocks, first, last, plan.pp, plan.zero, plan.dp)
        assert len(groups) == (2 if plan.pp > 1 and (first or last) else 1) or plan.zero == 3  # tied alone, 1 bucket
        assert r.num_parameters == owned_parameters(groups, plan.zero, plan.dp)
        assert r.state_bytes == state_bytes(groups, plan.zero, plan.dp), r.rank
        expected = expected_traffic(shape, plan.dp, plan.tp, plan.pp, j, blocks, plan.micro_batches, rows,
                                    run.seq_len, plan.recompute, plan.zero)
        assert {k: v for k, v in r.traffic.items() if v} == {k: v for k, v in expected.items() if v}, r.rank
        if plan.zero <= 1:  # the ring: each rank sends 2 (N - 1) / N of its padded flat groups, the ZeRO paper's
            assert r.wire["dp"] == pytest.approx(zero_traffic(sum(groups), plan.dp, plan.zero, "fp32"), rel=1e-12)
            assert r.wire["dp"] == pytest.approx(ring_wire_bytes("all_reduce", 4 * sum(groups), plan.dp), rel=1e-12)
        elif plan.zero == 2:  # ZeRO-2 reduce-scatters after every micro-batch's backward: m + 1 halves of the ring
            assert r.wire["dp"] == (plan.micro_batches + 1) * (2 - 1) / 2 * 4 * sum(groups)
        else:  # ZeRO-3: two all-gathers and a reduce-scatter per micro-batch, 3m halves of the ring (issue #21)
            assert r.wire["dp"] == 3 * plan.micro_batches * (2 - 1) / 2 * 4 * sum(groups)
        # the cost package's formula, micro-batches included, is what the counter saw
        assert r.wire["dp"] == pytest.approx(zero_traffic(sum(groups), plan.dp, plan.zero, "fp32",
                                                          micro_batches=plan.micro_batches), rel=1e-12)
        assert r.wire["tp"] == wire_bytes(expected["tp"], plan.tp)


def test_the_padded_case_pads():
    """The dp8 case's one flat group is not a multiple of 8: the formulas count 4 padding values."""
    plan, run = CASES["dp8 zero1 padded"]
    shape = shape_of(run)
    assert stage_parameters(shape, 1, 3, True, True, 1) == 55_044
    assert dp_groups(shape, 1, 3, True, True, 1, plan.zero, plan.dp) == [55_048]


def test_measure_layout_refuses_a_run_with_nothing_to_time():
    with pytest.raises(ValueError, match="warmup"):
        measure_layout(1, 1, 1, steps=2, warmup=2)


def test_the_planner_gets_the_slowest_step_the_fullest_rank_and_the_busiest_sender(launched):
    results, plan = launched["1f1b zero0"], PLANS["1f1b zero0"]
    assert (plan.dp, plan.tp, plan.pp, plan.zero, plan.micro_batches) == (2, 2, 2, 0, 2)  # what the numbers below use
    step_seconds, state, traffic, _ = summarize_layout(results, warmup=1)
    assert step_seconds == job_step_times(results)[1] == max(r.record.step_times[1] for r in results)
    # the embedding's stage holds 18,016 values (STAGE_PARAMETERS[2, 2]) in 2 flat groups (the tied slice, the
    # rest): 16 bytes each at ZeRO-0 in fp32 (parameter, gradient, AdamW's two moments) and AdamW's step count
    # per group, 18,016 · 16 + 2 · 4 = 288,264 bytes; its ring all-reduce sends 2 (2 - 1)/2 · 4 · 18,016 = 72,064
    assert state == 288_264
    assert traffic["dp"] == 72_064
    assert traffic["pp"] == 2 * 2 * 8 * 32 * 4  # m=2 micro-batches of (2, 8, 32), one each way


def _stage_census(rank: int, world_size: int) -> dict:
    """One pure-PP rank (tp=1): its run with the shard's other stages freed and with them kept, then the census
    of building stage ``rank`` of a TP shard onto the meta device."""
    import torch.distributed as dist
    from _census import Moved, live_parameters

    from parallel_lib.common.models import build_gpt2
    from parallel_lib.tensor_parallel.convert import tensor_parallelize
    from parallel_lib.training import train
    from parallel_lib.training.step import stage_on_device
    plan, run = Plan(pp=2), replace(RUN, batch_size=4, timeout=60.0, return_state=False)
    freed, kept = train(rank, world_size, plan, run), train(rank, world_size, plan, replace(run, return_state=True))
    groups = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group
    try:
        shard = tensor_parallelize(build_gpt2("tiny", 64, 0, n_layer=4, n_embd=32), groups[rank], dropout_seed=0)
        whole = sum(p.numel() for p in shard.parameters())
        host_before = live_parameters("cpu") - whole  # what the process holds besides the shard
        with Moved() as moved:
            stage = stage_on_device(shard, rank, world_size, torch.device("meta"), keep_shard=False)
        del shard
        return dict(losses=(freed.record.losses, kept.record.losses), state_bytes=(freed.state_bytes, kept.state_bytes),
                    whole=whole, moved=moved.numel,
                    held=sum(t.numel() for t in [*stage.parameters(), *stage.buffers()]),
                    host_left=live_parameters("cpu") - host_before)
    finally:
        for group in groups:
            dist.destroy_process_group(group)


def test_a_pipeline_rank_holds_only_its_stage_of_the_tp_shard():
    """GPU item 4: the 3D run used to move the whole TP shard to the stage's device and keep it alive (the stage
    refers to the shard). Now only the stage's tensors reach the device, the shard's other stages are freed,
    and training is unchanged (the same losses as a run that keeps the shard for return_state)."""
    for rank, census in enumerate(launch(_stage_census, 2, threads_per_rank=1, timeout=240, startup_timeout=240)):
        assert census["losses"][0] == pytest.approx(census["losses"][1], nan_ok=True), rank  # NaN: not the last stage
        assert census["state_bytes"][0] == census["state_bytes"][1], rank
        assert census["moved"] == census["held"] < census["whole"], rank  # the device got the stage, nothing more
        assert census["host_left"] == 0, rank  # and nothing of the other stage stays alive on the host


def _engine_groups(rank: int, world_size: int, cap_mb: float) -> dict:
    """The padded sizes of the flat groups ZeroEngine builds over each stage of a pp=2 split, per ZeRO stage."""
    from parallel_lib.common.models import build_gpt2
    from parallel_lib.runtime.mesh import Mesh
    from parallel_lib.sharding.zero import ZeroEngine
    from parallel_lib.tensor_parallel.convert import tensor_parallelize
    from parallel_lib.training.tp_stage import TensorParallelStage

    out = {}
    with Mesh(dp=world_size).build(60.0) as pm:
        for zero in range(4):
            for j in range(2):
                shard = tensor_parallelize(build_gpt2("tiny", 64, 0, n_layer=4, n_embd=32), pm.group("tp"),
                                           dropout_seed=0)
                stage = TensorParallelStage(shard, j, 2)
                engine = ZeroEngine(stage, zero, layer_groups=list(stage.h), group=pm.group("dp"), separate=stage.tied,
                                    bucket_cap_mb=cap_mb)
                out[zero, j] = [g.padded for g in engine.groups]
                engine.remove()
    return out


def test_the_formulas_flat_groups_are_the_engines_with_several_buckets():
    """dp_groups predicts ZeroEngine's buckets (here 16 KiB ones: several per stage) and layer groups."""
    cap = 16 / 1024
    engine = launch(_engine_groups, 2, cap, threads_per_rank=1, timeout=240, startup_timeout=240)[0]
    for (zero, j), groups in engine.items():
        assert dp_groups(SHAPE, 1, 2, j == 0, j == 1, 2, zero, 2, bucket_cap_mb=cap) == groups, (zero, j)
        assert len(groups) > 3, groups


def test_dropout_through_a_tp_pipeline_with_recomputation_draws_one_process_masks():
    """Every stage numbers a micro-batch's forward as one process does, in its recomputation too."""
    run = RunConfig(dropout=0.1, steps=2, batch_size=4)
    plans = [Plan(tp=2, pp=2, micro_batches=1, recompute=True), Plan(tp=2, pp=2, micro_batches=1, schedule="gpipe")]
    per_rank = launch(train_many, 4, [(plan, run) for plan in plans], backend="gloo", timeout=180)
    losses, state = reference(run)
    assert losses != pytest.approx(reference(replace(run, dropout=0.0))[0], rel=1e-4)  # the dropout did drop
    for k, plan in enumerate(plans):
        results = [r[k] for r in per_rank]
        shares = [r.record.losses for r in results if r.coords["pp"] == 1 and r.coords["tp"] == 0]
        assert [sum(step) for step in zip(*shares)] == pytest.approx(losses, rel=1e-5), plan.name
        assert max(max_difference(results, state).values()) < 3e-4, plan.name
