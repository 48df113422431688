"""Tensor parallelism (chapter 07): every split layer and GPT-2 equal the dense model, traffic equals the formula.

Ranks are gloo processes on this CPU (``launch``). Each multi-rank test compares against
one process computing the dense model: outputs, gradients, and parameters after k AdamW
steps, gathered back into the dense layout.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import _workers

from parallel_lib.common import build_gpt2, gpt2_config
from parallel_lib.runtime import launch
from parallel_lib.tensor_parallel import (
    GPTShape,
    TPConfig,
    gather_dense,
    layer_collectives,
    naive_qkv_rows,
    qkv_rows,
    step_collectives,
    tensor_parallelize,
)
from parallel_lib.tensor_parallel.cost import activation_bytes, shard_parameters
from parallel_lib.tensor_parallel.verify import bad_input_check, block_saved_bytes, gpt2_check, many, mlp_check
from parallel_lib.tensor_parallel.vocab import vocab_range
from parallel_lib.training import Plan, RunConfig, max_difference, reference, tp_layout, train, train_many

TOL = 1e-5


def test_qkv_rows_keep_each_ranks_heads_of_q_k_and_v():
    # n_embd 8, 2 heads of 4: rank 1 keeps head 1 of q (4..7), of k (12..15) and of v (20..23)
    assert qkv_rows(8, 2, 1, 2).tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]
    # the contiguous split gives rank 0 all of q and half of k: the classic mistake
    assert naive_qkv_rows(8, 0, 2).tolist() == list(range(12))
    rows = torch.cat([qkv_rows(64, 4, r, 4) for r in range(4)])
    assert sorted(rows.tolist()) == list(range(192))  # every feature kept exactly once


def test_bad_sizes_name_the_argument():
    with pytest.raises(ValueError, match="n_head=4 is not divisible by the tensor-parallel size tp=3"):
        qkv_rows(64, 4, 0, 3)
    with pytest.raises(ValueError, match="vocab_size=127 is not divisible.*pad the vocabulary"):
        vocab_range(127, 0, 2)


def test_already_split_or_not_gpt2_is_refused():
    model = tensor_parallelize(build_gpt2("tiny", vocab_size=64))
    with pytest.raises(ValueError, match="already tensor-parallel"):
        tensor_parallelize(model)
    with pytest.raises(TypeError, match="GPT2LMHeadModel"):
        tensor_parallelize(torch.nn.Linear(2, 2))


def test_one_rank_forward_is_hugging_faces_gpt2_and_gathers_back():
    dense = build_gpt2("tiny", vocab_size=64).eval()
    model = tensor_parallelize(dense).eval()
    ids = torch.randint(0, 64, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 7:] = 0  # right padding
    expected = dense(ids, attention_mask=mask).logits
    got = model(ids, mask)
    assert (got - expected)[mask.bool()].abs().max() < TOL
    labels = torch.randint(0, 64, (2, 12))
    ce = F.cross_entropy(expected.flatten(0, 1), labels.flatten(), reduction="none")
    assert abs(model.loss(got, labels, mask.float()) - (ce * mask.flatten()).sum() / mask.sum()) < TOL
    back = gather_dense(model)
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), dense.state_dict().values()))


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_column_then_row_mlp_equals_dense(tp, sequence_parallel):
    result = launch(mlp_check, tp, sequence_parallel, backend="gloo", timeout=120)
    for rank, r in enumerate(result):
        counted = r.pop("collectives")
        assert max(r.values()) < TOL, (rank, r)
        # the MLP is half a block: half of a block's forward and backward collectives (TP: its forward g and
        # backward f, as much as a block's two forward g; SP: one more all-gather, its input gathered again)
        layer = layer_collectives(2, 8, 16, sequence_parallel)
        kinds = {**layer["forward"], **layer["backward"]}
        assert counted == {k: tuple((layer["forward"].get(k, (0, 0))[i] + layer["backward"].get(k, (0, 0))[i]) // 2
                                    for i in (0, 1)) for k in kinds}


@pytest.mark.parametrize("tp,sequence_parallel", [(2, False), (2, True), (4, False), (4, True)])
def test_gpt2_logits_loss_and_gradients_equal_dense(tp, sequence_parallel):
    """Also with every block recomputed (one launch runs both): the same gradients, and the counter sees
    the recomputed forward's collectives again, as ``step_collectives(recompute=True)`` counts (#21 error 6)."""
    config = TPConfig(sequence_parallel=sequence_parallel)
    per_rank = launch(many, tp, [(gpt2_check, (config,)), (gpt2_check, (config, False, True))], backend="gloo",
                      timeout=120)
    shape = GPTShape.of(gpt2_config("tiny", config.vocab_size))
    for plain, recomputed in per_rank:
        for recompute, r in ((False, plain), (True, recomputed)):
            assert r["logits"] < TOL and r["loss"] < TOL and r["grads"] < TOL, r
            # a whole step without the SP gradient all-reduce (made after the counted block)
            expected = step_collectives(shape, config.batch_size, config.seq_len, tp, sequence_parallel,
                                        recompute=recompute)
            if sequence_parallel:
                calls, nbytes = expected["all_reduce"]
                sync = (shape.n_layer * 6 + 2 + shape.n_positions) * shape.n_embd * 4
                expected["all_reduce"] = (calls - 1, nbytes - sync)
            assert r["step"] == expected
        if not sequence_parallel:  # Megatron's count: 6 all-reduces per block instead of 4, + embedding, head, loss
            assert recomputed["step"]["all_reduce"][0] == 6 * shape.n_layer + 2 + 3
            assert plain["step"]["all_reduce"][0] == 4 * shape.n_layer + 2 + 3


def test_the_activation_formula_is_the_census_of_one_block_under_tp_and_sp():
    """#21 error 9: what one block keeps for backward, counted by the tensor census, is the formula's terms
    in fp32 with the course's dropout masks (4 bytes each), plus what the paper leaves out: the layer norms'
    statistics (mean and 1/std, 2 x 2 fp32 values per token) and the attention mask the blocks share (s² bools).
    Under SP the column-parallel layers keep only their slice of the input, as Megatron does."""
    b, s, shape = 2, 16, GPTShape(1, 64, 4, 64, 128)  # tiny's block
    cases = [(sp, p) for sp in (False, True) for p in (0.0, 0.1)]
    measured = dict(zip(cases, launch(many, 2, [(block_saved_bytes, case) for case in cases], backend="gloo",
                                      timeout=120)[0]))
    for p in (0.0, 0.1):  # one process: t = 1
        measured[(None, p)] = block_saved_bytes(0, 1, False, p)
    for (sp, p), got in measured.items():
        t = 1 if sp is None else 2
        tokens = s // t if sp else s  # the norms run on this rank's slice of the sequence under SP
        formula = activation_bytes(b, s, shape, t, bool(sp), dropout=p > 0, bytes_per_element=4, mask_bytes=4)
        assert got == formula + 2 * 2 * 4 * b * tokens + s * s, (sp, p)
    # literals (b·s·h = 2,048 values of 4 bytes): without dropout, t = 2 keeps 4 whole + 12/2 of them per block
    # under TP, 16/2 under SP, beside the scores' a·s²·b/t = 1,024 values
    assert measured[(False, 0.0)] == 4 * (2048 * (4 + 6) + 1024 + 2 * 2 * 32) + 256 == 86_784
    assert measured[(True, 0.0)] == 4 * (2048 * 8 + 1024 + 2 * 2 * 16) + 256 == 70_144


def test_naive_c_attn_split_is_wrong():
    result = launch(gpt2_check, 2, TPConfig(), True, backend="gloo", timeout=120)[0]
    assert result["logits"] > 1e-2 and result["grads"] > 1e-3


def _global_losses(results) -> list[float]:
    """Every step's global loss: the sum of the replicas' shares (tensor slice 0 of each replica)."""
    shares = [r.record.losses for r in results if r.coords["tp"] == 0]
    return [sum(step) for step in zip(*shares)]


def test_training_with_tp_and_sp_equals_one_process_and_sp_saves_activations():
    saved = {}
    for sequence_parallel in (False, True):
        config = TPConfig(sequence_parallel=sequence_parallel, steps=3)
        plan, run = tp_layout(config, 2)
        results = launch(train, 2, plan, run, backend="gloo", timeout=180)
        losses, state = reference(run)
        shape = GPTShape.of(gpt2_config(config.model, config.vocab_size))
        assert _global_losses(results) == pytest.approx(losses, rel=1e-5)
        # AdamW turns gradient differences of ~1e-8 into updates of up to lr on near-zero gradients
        assert max(max_difference(results, state).values()) < 3e-4
        for r in results:
            assert r.collectives == step_collectives(shape, config.batch_size, config.seq_len, 2, sequence_parallel)
            assert r.parameter_bytes == 4 * shard_parameters(shape, 2)
        saved[sequence_parallel] = results[0].activation_bytes
    assert saved[True] < saved[False]


def test_four_way_training_and_dropout_equal_one_process():
    config = TPConfig(dropout=0.1, steps=2)
    plan, run = tp_layout(config, 4)
    results = launch(train, 4, plan, run, backend="gloo", timeout=180)
    losses, state = reference(run)  # the one GPT-2 drawing the same seeded masks in one process
    assert _global_losses(results) == pytest.approx(losses, rel=1e-5)
    assert losses != pytest.approx(reference(tp_layout(TPConfig(steps=2), 4)[1])[0], rel=1e-4)  # the dropout did drop
    assert max(max_difference(results, state).values()) < 3e-4


def test_tensor_times_data_parallel_with_dropout_draws_each_replicas_own_masks():
    """#22 item 5: every replica drew the same masks on its own rows (the --check reported 6e-3). One
    process that runs each replica's rows (and micro-batches) with that replica's masks is the proof."""
    run = RunConfig(dropout=0.1, steps=2, batch_size=8)
    plans = [Plan(dp=2, tp=2, micro_batches=1, sequence_parallel=True), Plan(dp=2, tp=2, micro_batches=2)]
    per_rank = launch(train_many, 4, [(plan, run) for plan in plans], backend="gloo", timeout=240)
    for k, plan in enumerate(plans):
        results = [r[k] for r in per_rank]
        losses, state = reference(run, dp=2, micro_batches=plan.micro_batches)
        assert _global_losses(results) == pytest.approx(losses, rel=1e-5), plan.name
        assert max(max_difference(results, state).values()) < 3e-4, plan.name
    same_masks = reference(run, dp=1)  # one mask over the whole batch: what a replica-blind run would match
    assert same_masks[0] != pytest.approx(reference(run, dp=2)[0], rel=1e-4)  # the replicas' masks differ


def test_tensor_times_data_parallel_on_four_ranks_equals_one_process():
    config = TPConfig(tp=2, steps=2, sequence_parallel=True)
    plan, run = tp_layout(config, 4)
    results = launch(train, 4, plan, run, backend="gloo", timeout=180)
    losses, state = reference(run)
    assert [(r.plan.tp, r.plan.dp) for r in results] == [(2, 2)] * 4
    assert [(r.coords["dp"], r.coords["tp"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]  # rank = d·tp + t
    assert _global_losses(results) == pytest.approx(losses, rel=1e-5)
    assert max(max_difference(results, state).values()) < 3e-4


def test_a_tp_that_does_not_divide_the_world_is_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match="tp=2 must divide world_size=3"):
        tp_layout(TPConfig(tp=2), 3)
    with pytest.raises(ValueError, match="world_size"):
        tp_layout(TPConfig(), 0)


@pytest.mark.parametrize("config, match", [
    (TPConfig(n_layer=-1), "n_layer must be an int >= 0, got n_layer=-1"),  # #22 item 10: trained no blocks
    (TPConfig(n_embd=66), "n_embd=66 is not divisible by the tiny model's n_head=4"),
    (TPConfig(tp=-1), "tp must be an int >= 0, got tp=-1"),
    (TPConfig(tp=True), "tp must be an int >= 0, got tp=True"),
    (TPConfig(model="huge"), "model must be one of"),
])
def test_a_model_no_rank_could_build_is_refused_by_tp_layout(config, match):
    with pytest.raises(ValueError, match=match):
        tp_layout(config, 2)


def test_heads_not_divisible_and_foreign_group_are_clear_errors():
    results = launch(bad_input_check, 3, backend="gloo", timeout=120)
    assert "n_head=4 is not divisible by the tensor-parallel size tp=3" in results[1]["heads"]
    assert "group does not contain this process (global rank 0" in results[0]["group"]



def test_pytorch_dtensor_split_gives_the_same_outputs_and_the_pitfall_shows_there_too():
    from parallel_lib.tensor_parallel.dtensor import dtensor_check

    for r in launch(dtensor_check, 2, TPConfig(), backend="gloo", timeout=120):
        assert r["logits"] < TOL and r["loss"] < TOL and r["c_attn_grad"] < TOL, r
        assert r["naive_logits"] > 1e-2  # ColwiseParallel on the fused c_attn as stored: wrong heads


def test_many_runs_in_one_launch_leave_no_process_groups_behind():
    """Each run's mesh destroys the groups it made (before the mesh, every run added 2 + dp + tp groups)."""
    before, between, after = launch(_workers.tp_runs_leave_no_groups, 4, TPConfig(tp=2, steps=1), timeout=180)[0]
    assert before == between == after
