"""Tests for the 3D run: DP × TP × PP = 2 × 2 × 2 on 8 gloo ranks equals one process, traffic equals the formulas.

Starting eight ranks is the slow part (each imports torch and transformers), so ONE launch
runs both configs: 1F1B with SGD on the course's grid order, and GPipe with recomputation
and AdamW on Megatron's default order. The model is tiny GPT-2 narrowed to 32 features, the
sequences 8 tokens: the point is the bookkeeping, not the arithmetic.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from parallel_lib.hybrid.cost3d import expected_traffic, stage_parameters, stage_tensors, state_bytes, wire_bytes
from parallel_lib.hybrid.dp_tp_pp import Config3D, run_3d_many
from parallel_lib.hybrid.layout3d import job_step_times, max_difference, measure_layout, reference_3d, summarize_layout
from parallel_lib.runtime import launch
from parallel_lib.runtime.collectives import ring_wire_bytes
from parallel_lib.tensor_parallel.cost import GPTShape, shard_parameters, step_collectives

# SGD with a large step: its update is proportional to the gradient, so a gradient summed
# instead of averaged over dp, a tied copy left unsummed or a wrong loss scale shows at once
BASE = Config3D(dp=2, tp=2, pp=2, n_layer=4, n_embd=32, vocab_size=64, seq_len=8, batch_size=8, micro_batches=2,
                steps=2, optimizer="sgd", lr=0.5, return_state=True, timeout=120.0)
CONFIGS = {"1f1b sgd": BASE,
           "gpipe recompute adamw tp-dp-pp": replace(BASE, schedule="gpipe", recompute=True, optimizer="adamw",
                                                     lr=1e-2, order="tp-dp-pp")}
# float32 sums in another order (all-reduces, micro-batches) differ by ~1e-7; measured: 3e-8 with
# SGD (a missing 1/dp or tied sum moves parameters by ~1e-2 at lr = 0.5), 2.5e-5 with AdamW,
# which divides by sqrt(v) and so lifts the noise of near-zero gradients (a wrong update there is ~lr = 1e-2)
TOLERANCE = {"1f1b sgd": 1e-5, "gpipe recompute adamw tp-dp-pp": 2e-4}
SHAPE = GPTShape(4, 32, 4, 64, 128)  # tiny's 4 heads and 128 positions, narrowed


@pytest.fixture(scope="module")
def launched() -> dict[str, list]:
    per_rank = launch(run_3d_many, 8, list(CONFIGS.values()), threads_per_rank=1, timeout=300, startup_timeout=300)
    return {name: [results[k] for results in per_rank] for k, name in enumerate(CONFIGS)}


@pytest.mark.parametrize("change, match", [
    (dict(tp=3), "world_size"), (dict(tp=8, dp=1, pp=1), "n_head"), (dict(batch_size=6), "batch_size"),
    (dict(pp=8, dp=1, tp=1), "pp"), (dict(schedule="zb"), "schedule")])
def test_a_config_that_cannot_run_is_refused_before_any_rank_starts(change, match):
    with pytest.raises(ValueError, match=match):
        replace(BASE, **change).check(world_size=8)


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (2, 2), (4, 4)])
def test_stage_formulas_add_up_to_chapter_07s(tp, pp):
    from parallel_lib.hybrid.tp_stages import stage_blocks

    blocks = [len(b) for b in stage_blocks(SHAPE.n_layer, pp)]
    params = [stage_parameters(SHAPE, tp, blocks[j], j == 0, j == pp - 1, pp) for j in range(pp)]
    head_copy = SHAPE.vocab_size * SHAPE.n_embd // tp if pp > 1 else 0
    assert sum(params) == shard_parameters(SHAPE, tp) + head_copy
    m, rows = 3, 2  # the stages' collectives of m micro-batches are chapter 07's step, m times
    per_stage = [expected_traffic(SHAPE, 1, tp, pp, j, blocks[j], m, rows, 8)["tp"] for j in range(pp)]
    whole = step_collectives(SHAPE, rows, 8, tp)
    assert {k: tuple(sum(s[k][i] for s in per_stage) for i in (0, 1)) for k in whole} == \
        {k: (m * c, m * b) for k, (c, b) in whole.items()}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parameters_and_losses_equal_one_process(launched, name):
    results, config = launched[name], CONFIGS[name]
    losses, reference = reference_3d(config)
    differences = max_difference(results, reference)
    assert max(differences.values()) < TOLERANCE[name], sorted(differences.items(), key=lambda kv: -kv[1])[:3]
    assert "lm_head.weight" in differences  # the last stage's copy of the tied embedding, checked too
    last = [r for r in results if r.coords[1] == config.pp - 1 and r.coords[2] == 0]
    job = [sum(r.record.losses[k] for r in last) for k in range(config.steps)]
    assert job == pytest.approx(losses, rel=1e-5)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_each_groups_traffic_and_the_census_equal_the_formulas(launched, name):
    config = CONFIGS[name]
    for r in launched[name]:
        d, j, t = r.coords
        rows = config.batch_size // config.dp // config.micro_batches
        expected = expected_traffic(SHAPE, config.dp, config.tp, config.pp, j, len(r.blocks), config.micro_batches,
                                    rows, config.seq_len, config.recompute)
        assert {k: v for k, v in r.traffic.items() if v} == {k: v for k, v in expected.items() if v}, r.rank
        # the dp ring: each rank sends 2 (N - 1) / N of its stage's gradients
        params = stage_parameters(SHAPE, config.tp, len(r.blocks), j == 0, j == config.pp - 1, config.pp)
        assert r.wire["dp"] == ring_wire_bytes("all_reduce", 4 * params, config.dp) == 2 * (2 - 1) / 2 * 4 * params
        assert r.wire["tp"] == wire_bytes(expected["tp"], config.tp)
        assert r.num_parameters == params
        tensors = stage_tensors(len(r.blocks), j == 0, j == config.pp - 1, config.pp)
        assert r.state_bytes == state_bytes(params, config.optimizer, tensors)


def test_measure_layout_refuses_a_run_with_nothing_to_time():
    with pytest.raises(ValueError, match="warmup"):
        measure_layout(1, 1, 1, steps=2, warmup=2)


def test_the_planner_gets_the_slowest_step_the_fullest_rank_and_the_busiest_sender(launched):
    results, config = launched["1f1b sgd"], CONFIGS["1f1b sgd"]
    step_seconds, state, traffic, _ = summarize_layout(results, warmup=1)
    assert step_seconds == job_step_times(results)[1] == max(r.step_times[1] for r in results)
    fullest = max(stage_parameters(SHAPE, 2, 2, j == 0, j == 1, 2) for j in range(2))  # the embedding's stage
    assert state == state_bytes(fullest, config.optimizer)
    assert traffic["dp"] == 2 * (2 - 1) / 2 * 4 * fullest and traffic["pp"] == 2 * 2 * 8 * 32 * 4  # m=2 (2, 8, 32)


def _stage_census(rank: int, world_size: int) -> dict:
    """One pure-PP rank (tp=1): its run with the shard's other stages freed and with them kept, then the census
    of building stage ``rank`` of a TP shard onto the meta device."""
    import torch.distributed as dist
    from _census import Moved, live_parameters

    from parallel_lib.common.models import build_gpt2
    from parallel_lib.hybrid.dp_tp_pp import _stage_on_device, run_3d
    from parallel_lib.tensor_parallel.convert import tensor_parallelize
    config = Config3D(dp=1, tp=1, pp=2, n_layer=4, n_embd=32, vocab_size=64, seq_len=8, batch_size=4, micro_batches=2,
                      steps=2, optimizer="sgd", lr=0.5, timeout=60.0)
    freed, kept = run_3d(rank, world_size, config), run_3d(rank, world_size, replace(config, return_state=True))
    groups = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group
    try:
        shard = tensor_parallelize(build_gpt2("tiny", 64, 0, n_layer=4, n_embd=32), groups[rank], dropout_seed=0)
        whole = sum(p.numel() for p in shard.parameters())
        host_before = live_parameters("cpu") - whole  # what the process holds besides the shard
        with Moved() as moved:
            stage = _stage_on_device(shard, rank, world_size, torch.device("meta"), keep_shard=False)
        del shard
        return dict(losses=(freed.record.losses, kept.record.losses), state_bytes=(freed.state_bytes, kept.state_bytes),
                    whole=whole, moved=moved.numel,
                    held=sum(t.numel() for t in [*stage.parameters(), *stage.buffers()]),
                    host_left=live_parameters("cpu") - host_before)
    finally:
        for group in groups:
            dist.destroy_process_group(group)


def test_a_pipeline_rank_holds_only_its_stage_of_the_tp_shard():
    """GPU item 4: run_3d used to move the whole TP shard to the stage's device and keep it alive (the stage
    refers to the shard). Now only the stage's tensors reach the device, the shard's other stages are freed,
    and training is unchanged (the same losses as a run that keeps the shard for return_state)."""
    for rank, census in enumerate(launch(_stage_census, 2, threads_per_rank=1, timeout=240, startup_timeout=240)):
        assert census["losses"][0] == pytest.approx(census["losses"][1], nan_ok=True), rank  # NaN: not the last stage
        assert census["state_bytes"][0] == census["state_bytes"][1], rank
        assert census["moved"] == census["held"] < census["whole"], rank  # the device got the stage, nothing more
        assert census["host_left"] == 0, rank  # and nothing of the other stage stays alive on the host
