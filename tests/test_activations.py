"""Activation memory counted from autograd's saved tensors; recomputation and accumulation."""

import copy

import pytest
import torch
from torch import nn

from parallel_lib.common import build_gpt2
from parallel_lib.common.activations import measure_step_activations, set_recomputation
from parallel_lib.common.saved_tensors import SavedTensors


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


def test_a_saved_view_counts_the_bytes_it_reaches_each_storage_once():
    """A micro-batch is a slice of the batch, a broadcast a view of a few values: each counts what it holds.
    The course had three counters: this one counted the slice's whole storage (the batch, 4 times too much),
    the pipeline stage's counted the broadcast as if it were whole (8 rows instead of 1)."""
    layer = nn.Linear(64, 64, bias=False)
    batch = torch.randn(32, 64)
    with SavedTensors(layer) as saved:
        layer(batch[:8])  # saves its input: rows 0-7 of the batch, 8 · 64 · 4 bytes
    assert saved.nbytes == 2048 and saved.count == 1
    x, row = torch.randn(8, 64, requires_grad=True), torch.randn(1, 64, requires_grad=True)
    with SavedTensors() as saved:
        x * row.expand(8, 64)  # saves x (8 · 64 · 4) and the broadcast row (its 64 values, 4 bytes each)
    assert saved.nbytes == 2048 + 256
    qkv = torch.randn(2, 8, 12, requires_grad=True) * 1  # q, k, v: thirds of the last dimension, all saved
    q, k, v = qkv.split(4, dim=-1)
    with SavedTensors() as saved:
        (q @ k.transpose(1, 2)) @ v  # together they reach the whole (2, 8, 12) storage
    assert saved.nbytes == 2 * 8 * 12 * 4 + 2 * 8 * 8 * 4  # qkv, and the scores q·kᵀ saved by the second product


def test_a_pipeline_stage_reports_the_census():
    """StageRunner's ``last_saved_bytes`` (chapters 04 and 08's peaks) is this counter: parameters and buffers
    left out, the broadcast counted once."""
    from parallel_lib.pipeline_parallel.stage import StageRunner

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(64, 64)
            self.register_buffer("offset", torch.ones(64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.linear(x) + self.offset
            return h * h.mean(0, keepdim=True).expand_as(h)

    runner = StageRunner(Scaled(), torch.device("cpu"), first=False)
    runner.forward(torch.randn(8, 64), None)
    # the linear's input (8 · 64 · 4 = 2,048), h for the product (2,048), the broadcast mean (64 · 4 = 256)
    assert runner.last_saved_bytes == 2048 + 2048 + 256


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
