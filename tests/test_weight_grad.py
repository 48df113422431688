"""The split backward (B, then W) of zero-bubble schedules: exact, and W is only the weight products.

B then W must give the bits of one whole backward (fp32, CPU), for GPT-2 on one stage (its head
tied to the embedding), for a pipeline's first and last stage (the tied copies), with a parameter
used outside the recorded operations, and with recomputation. W must run the weight-gradient
products only: its FLOPs are exactly those of the weight GEMMs, and B's plus W's are one whole
backward's (under the old per-layer cut, W ran each layer's internal backward again). And the
split costs no more autograd calls than a whole backward: B is the stage's one call, W none
(when each operation kept a small graph of its own, B called autograd again for every layer norm
and W once over all the small graphs).
"""

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from parallel_lib.common.models import build_gpt2, gpt2_config
from parallel_lib.models.gpt2 import GPT2
from parallel_lib.pipeline_parallel import gpt2_stages, lm_loss
from parallel_lib.pipeline_parallel.stage import StageRunner
from parallel_lib.pipeline_parallel.weight_grad import record_weight_ops

CPU = torch.device("cpu")
WIDTH, VOCAB, SEQ, BATCH = 32, 97, 16, 3


def _gpt2() -> GPT2:
    return GPT2(gpt2_config("tiny", vocab_size=VOCAB, n_layer=2, n_embd=WIDTH, n_head=2, n_positions=SEQ,
                            embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0))


def _whole_then_split(runner: StageRunner, x, loss=None, grad=None, recompute=False):
    """(gradients of one whole backward, of B then W, input gradients of both, whether B wrote .grad)."""
    params = list(runner.module.parameters())
    saved, _ = runner.forward(x, loss, recompute=recompute)
    dx_whole = runner.backward(saved, grad)
    whole = [p.grad.clone() for p in params]
    runner.module.zero_grad(set_to_none=True)
    saved, _ = runner.forward(x, loss, recompute=recompute, split=True)
    dx_split, todo = runner.backward_input(saved, grad)
    wrote = any(p.grad is not None for p in params)
    runner.backward_weight(todo)
    return whole, [p.grad for p in params], (dx_whole, dx_split), wrote


def test_gpt2_on_one_stage_with_its_tied_head_splits_bitwise():
    model = _gpt2()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    runner = StageRunner(model, CPU, first=True)
    whole, split, _, wrote = _whole_then_split(runner, ids, lambda logits: model.loss(logits, ids))
    assert not wrote  # B computes no weight gradient
    assert model.lm_head.weight is model.transformer.wte.weight  # one parameter, two operations
    assert all(torch.equal(a, b) for a, b in zip(whole, split))


@pytest.mark.parametrize("stage", [0, 1])
def test_gpt2_pipeline_stages_split_bitwise(stage):
    # the first stage (embeddings, whose B computes every activation gradient but none of its input)
    # and the last (the head's own copy of the tied embedding), as gpt2_stages cuts Hugging Face's model
    torch.manual_seed(0)
    stages = gpt2_stages(build_gpt2("tiny", vocab_size=VOCAB, n_layer=2, n_embd=WIDTH, n_head=2, n_positions=SEQ,
                                    embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0), ["cpu", "cpu"])
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    if stage == 0:
        x, loss, grad = ids, None, torch.randn(BATCH, SEQ, WIDTH, generator=generator)
    else:
        x, loss, grad = torch.randn(BATCH, SEQ, WIDTH, generator=generator), lambda y: lm_loss(y, ids), None
    runner = StageRunner(stages[stage], CPU, first=stage == 0)
    whole, split, (dx_whole, dx_split), _ = _whole_then_split(runner, x, loss, grad)
    assert all(torch.equal(a, b) for a, b in zip(whole, split))
    assert stage == 0 or torch.equal(dx_whole, dx_split)


def test_a_parameter_used_outside_the_recorded_operations_gets_its_gradient_from_b():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear, self.scale = nn.Linear(4, 4), nn.Parameter(torch.full((4,), 0.5))

        def forward(self, x):
            return torch.tanh(self.linear(x) * self.scale) @ self.linear.weight  # weight: recorded and not

    torch.manual_seed(0)
    runner = StageRunner(Scaled(), CPU, first=False)
    x, grad = torch.randn(5, 4), torch.randn(5, 4)
    whole, split, (dx_whole, dx_split), _ = _whole_then_split(runner, x, grad=grad)
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(whole, split))
    assert torch.equal(dx_whole, dx_split)


def test_a_recomputed_stage_splits_bitwise():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 3))
    runner = StageRunner(model, CPU, first=False)
    x, grad = torch.randn(4, 6), torch.randn(4, 3)
    whole, split, (dx_whole, dx_split), _ = _whole_then_split(runner, x, grad=grad, recompute=True)
    assert all(torch.equal(a, b) for a, b in zip(whole, split))
    assert torch.equal(dx_whole, dx_split)


def test_w_runs_only_the_weight_gemms_and_b_plus_w_is_one_whole_backward():
    model = _gpt2()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    runner = StageRunner(model, CPU, first=True)
    loss = lambda logits: model.loss(logits, ids)  # noqa: E731
    saved, _ = runner.forward(ids, loss)
    with FlopCounterMode(display=False) as whole:
        runner.backward(saved, None)
    saved, _ = runner.forward(ids, loss, split=True)
    with FlopCounterMode(display=False) as b:
        _, todo = runner.backward_input(saved, None)
    with FlopCounterMode(display=False) as w:
        runner.backward_weight(todo)
    tokens, h = BATCH * SEQ, WIDTH
    # per block: c_attn (h x 3h), attention's c_proj (h x h), c_fc (h x 4h), the MLP's c_proj (4h x h); the head (h x V)
    weight_gemms = 2 * tokens * (2 * (3 * h * h + h * h + 4 * h * h + 4 * h * h) + h * VOCAB)
    assert w.get_total_flops() == weight_gemms
    assert b.get_total_flops() + w.get_total_flops() == whole.get_total_flops()


def test_b_is_the_stages_one_autograd_call_and_w_makes_none(monkeypatch):
    model = _gpt2()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(4))
    runner = StageRunner(model, CPU, first=True)
    saved, _ = runner.forward(ids, lambda logits: model.loss(logits, ids), split=True)
    calls = []
    grad = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: calls.append(1) or grad(*a, **k))
    _, todo = runner.backward_input(saved, None)
    in_b = len(calls)
    runner.backward_weight(todo)
    assert (in_b, len(calls) - in_b) == (1, 0)  # before: (6, 1), a second call for each of the 5 layer norms
    assert all(p.grad is not None for p in model.parameters())


class _Odd(nn.Module):
    """Calls outside the cut's fast layouts (they keep a small graph) beside ones inside them."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6, padding_idx=-1, scale_grad_by_freq=True)
        self.up = nn.Linear(6, 6, bias=False)
        self.norm = nn.LayerNorm(6)
        self.side = nn.Linear(5, 6)
        self.bias, self.weight = nn.Parameter(torch.randn(6)), nn.Parameter(torch.randn(6, 6))

    def forward(self, ids):
        h = self.norm(self.up(self.emb(ids)))  # 3-D: (2, 5, 6)
        h = self.side(h.transpose(1, 2)).transpose(1, 2)  # a non-contiguous input: a small graph
        flat = h.reshape(-1, 6)
        return torch.addmm(self.bias, flat, self.weight, beta=0.5).sum()  # beta: a small graph


def test_calls_outside_the_fast_layouts_keep_a_small_graph_and_still_split_bitwise():
    torch.manual_seed(0)
    model = _Odd()
    ids = torch.tensor([[1, 2, 10, 2, 3], [10, 4, 4, 5, 1]])
    with record_weight_ops() as recorder:
        model(ids)
    kinds = [type(op).__name__ for op in recorder.ops]
    assert kinds == ["_EmbeddingOp", "_LinearOp", "_NormOp", "_GraphOp", "_GraphOp"]
    runner = StageRunner(model, CPU, first=True)
    whole, split, _, wrote = _whole_then_split(runner, ids, None, None)
    assert not wrote
    assert all(torch.equal(a, b) for a, b in zip(whole, split))


def test_under_autocast_the_operations_keep_small_graphs_with_the_cast_operands():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 3))
    runner = StageRunner(model, CPU, first=False)
    x, grad = torch.randn(4, 6), torch.randn(4, 3, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        whole, split, (dx_whole, dx_split), _ = _whole_then_split(runner, x, grad=grad)
    assert all(torch.equal(a, b) for a, b in zip(whole, split))
    assert torch.equal(dx_whole, dx_split)


def test_b_needs_a_forward_that_recorded_its_operations():
    runner = StageRunner(nn.Linear(2, 2), CPU, first=False)
    saved, _ = runner.forward(torch.randn(3, 2))
    with pytest.raises(ValueError, match=r"backward_input needs a forward run with split=True .*"
                                         r"runner.forward\(x, loss, split=True\)"):
        runner.backward_input(saved, torch.ones(3, 2))
