"""Activation memory counted from autograd's saved tensors; recomputation and accumulation."""

import copy

import pytest
import torch
from torch import nn

from parallel_lib.common import build_gpt2
from parallel_lib.common.activations import SavedTensors, measure_step_activations, set_recomputation


def test_counts_each_saved_storage_once_and_leaves_out_parameters():
    layer = nn.Linear(8, 8, bias=False)
    x = torch.randn(4, 8, requires_grad=True)
    with SavedTensors(layer) as saved:
        h = layer(x)  # saves x (for the weight's gradient) and the weight (excluded)
        y = torch.sin(h) * torch.cos(h)  # sin and cos save h: one storage
    assert saved.nbytes == x.numel() * 4 + h.numel() * 4 + 2 * h.numel() * 4  # x, h, and the two products' inputs
    y.sum().backward()


def test_counts_nothing_without_grad():
    with SavedTensors() as saved, torch.no_grad():
        torch.sin(torch.randn(100, requires_grad=True))
    assert saved.nbytes == 0 and saved.count == 0


def test_exclude_rejects_other_things():
    with pytest.raises(TypeError, match="exclude must hold modules or tensors"):
        SavedTensors(["model"])


@pytest.fixture(scope="module")
def gpt2_and_ids():
    torch.manual_seed(0)
    return build_gpt2("tiny", vocab_size=256), torch.randint(0, 256, (8, 32))


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_recomputation_keeps_less_and_gives_the_same_gradients(gpt2_and_ids):
    model, ids = gpt2_and_ids
    plain_model, recompute_model = copy.deepcopy(model), copy.deepcopy(model)
    plain = measure_step_activations(plain_model, [ids])
    recomputed = measure_step_activations(recompute_model, [ids], recompute=True)
    assert recomputed.saved_bytes < plain.saved_bytes / 3
    assert recomputed.loss == plain.loss
    expected = _grads(plain_model)
    assert all(torch.equal(g, expected[n]) for n, g in _grads(recompute_model).items())
    set_recomputation(recompute_model, False)
    assert measure_step_activations(recompute_model, [ids]).saved_bytes == plain.saved_bytes


def test_accumulation_keeps_one_micro_batch_and_matches_the_big_batch(gpt2_and_ids):
    model, ids = gpt2_and_ids
    whole, split = copy.deepcopy(model), copy.deepcopy(model)
    one = measure_step_activations(whole, [ids])
    four = measure_step_activations(split, list(ids.chunk(4)))
    assert 3.5 < one.saved_bytes / four.saved_bytes < 4.5
    expected = _grads(whole)
    for name, grad in _grads(split).items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-6)


def test_bad_micro_batches(gpt2_and_ids):
    model, ids = gpt2_and_ids
    with pytest.raises(ValueError, match="at least one"):
        measure_step_activations(model, [])
    with pytest.raises(ValueError, match="equal shapes"):
        measure_step_activations(model, [ids, ids[:3]])
    with pytest.raises(TypeError, match="Hugging Face"):
        set_recomputation(nn.Linear(2, 2))
