"""``parallelize_tp`` on the one GPT-2: 2 gloo ranks equal one process (logits, loss, parameters after AdamW)."""

from __future__ import annotations

import pytest
import torch

from parallel_lib.models import build_model, to_hf
from parallel_lib.runtime import launch
from parallel_lib.tensor_parallel import gather_dense, parallelize_tp
from parallel_lib.tensor_parallel.batches import TPConfig, make_batches
from _tp_workers import ids_outside_the_vocabulary, one_model_tp, stages_in_a_row, train_steps


def _one_process(config: TPConfig):
    model = build_model(config.model, config.vocab_size, config.seed, **config.overrides())
    logits, losses = train_steps(model, config, group=False)
    return logits, losses, model.state_dict()


@pytest.mark.parametrize("sequence_parallel,dropout,via_mesh", [(False, 0.0, False), (True, 0.1, True)])
def test_two_ranks_equal_one_process(sequence_parallel, dropout, via_mesh):
    config = TPConfig(sequence_parallel=sequence_parallel, dropout=dropout, steps=3)
    results = launch(one_model_tp, 2, config, via_mesh, backend="gloo", timeout=180)
    logits, losses, state = _one_process(config)
    mask = make_batches(config)[0]["attention_mask"].bool()  # padding queries' logits are never read
    for r in results:
        assert r["mesh_group"]  # the mesh's "tp" axis, or that group passed itself
        torch.testing.assert_close(r["logits"][mask], logits[mask], rtol=0, atol=1e-5)
        assert r["losses"] == pytest.approx(losses, rel=1e-5)
        assert list(r["state"]) == list(state)
        # AdamW turns gradient differences of ~1e-8 into updates of up to lr on near-zero gradients
        assert max(float((r["state"][k] - state[k]).abs().max()) for k in state) < 3e-4


def test_bad_models_and_options_are_refused():
    with pytest.raises(TypeError, match="model must be the one GPT2"):
        parallelize_tp(torch.nn.Linear(2, 2), None)
    model = parallelize_tp(build_model("tiny", 64), None)
    with pytest.raises(ValueError, match="already tensor-parallel"):
        parallelize_tp(model, None)
    with pytest.raises(ValueError, match="sequence_parallel=True needs vocab_parallel=True"):
        parallelize_tp(build_model("tiny", 64), None, sequence_parallel=True, vocab_parallel=False)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_pipeline_stages_of_a_tp_shard_run_the_same_model(sequence_parallel):
    # the stages are slices of model.transformer.h plus the ends: in a row they are the shard itself
    for r in launch(stages_in_a_row, 2, sequence_parallel, backend="gloo", timeout=120):
        assert r["shape"] == (4, 32, 64)  # this rank's half of the vocabulary, every token
        assert r["logits"] < 1e-5 and r["loss"] < 1e-6, r


@pytest.mark.parametrize("naive_qkv", [False, True])
def test_one_rank_split_gathers_back_exactly(naive_qkv):
    dense = build_model("tiny", 64, seed=3)
    split = parallelize_tp(build_model("tiny", 64, seed=3), None, naive_qkv=naive_qkv)
    assert type(split.transformer.h[0].attn.c_attn).__name__ == "ColumnParallelLinear"
    with pytest.raises(TypeError, match="gather it into a dense model first"):
        to_hf(split)
    back = gather_dense(split)
    for (k, a), b in zip(dense.state_dict().items(), back.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    ids = torch.randint(0, 64, (2, 10))
    torch.testing.assert_close(split.eval()(ids), dense.eval()(ids), rtol=0, atol=1e-5)


def test_ids_outside_the_vocabulary_raise_on_every_rank_and_minus_100_is_ignored_as_dense():
    for r in launch(ids_outside_the_vocabulary, 2, backend="gloo", timeout=120):
        for where in ("input", "labels"):
            for bad, (tp_error, dense_error) in r[where].items():
                assert dense_error, (where, bad)  # the dense model raises (IndexError)
                name = "input_ids" if where == "input" else "target"
                assert tp_error.startswith(f"ValueError: {name} holds id {bad}, outside the vocabulary of 64 "
                                           f"tokens"), tp_error
        torch.testing.assert_close(r["ce"], r["dense_ce"], rtol=0, atol=1e-5)
        assert (r["ce"][:, -3:] == 0).all()
        torch.testing.assert_close(r["grad"], r["dense_grad"], rtol=0, atol=1e-6)
        assert r["loss"] == pytest.approx(r["dense_loss"], rel=1e-6)
        torch.testing.assert_close(r["after"], r["dense_after"], rtol=0, atol=1e-5)
