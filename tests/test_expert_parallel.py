"""Chapter 12's mixture-of-experts layer in one process: routing, capacity and the balancing loss against
hand-computed literals, the dense MLP as its special case, the balancing loss at work, the traffic formula."""

from __future__ import annotations

import math

import pytest
import torch

from parallel_lib.expert_parallel import (Expert, MoE, MoEConfig, aux_loss_of, ep_traffic, expert_capacity, imbalance,
                                          keep_within_capacity, load_balancing_loss, rows_leaving, tokens_per_expert,
                                          tokens_per_rank, top_k_route)
from parallel_lib.models import build_model


def test_top_k_of_a_softmax_by_hand():
    logits = torch.tensor([[0.0, math.log(3.0), -1e9], [2.0, 2.0, 0.0]])
    r = top_k_route(logits, 1)
    torch.testing.assert_close(r.probs[0], torch.tensor([0.25, 0.75, 0.0]))
    assert r.experts.tolist() == [[1], [0]]  # the tie goes to the lower index
    torch.testing.assert_close(r.weights[:, 0], torch.tensor([0.75, math.exp(2) / (2 * math.exp(2) + 1)]))
    r2 = top_k_route(logits, 2, normalize=True)
    assert r2.experts.tolist() == [[1, 0], [0, 1]]
    torch.testing.assert_close(r2.weights, torch.tensor([[0.75, 0.25], [0.5, 0.5]]))


def test_capacity_keeps_first_choices_first():
    assert expert_capacity(4, 3, 2, 1.0) == 3          # ceil(8 / 3)
    assert expert_capacity(4, 3, 2, 0.75) == 2         # ceil(2.0): no rounding up past an exact integer
    assert expert_capacity(8, 4, 2, 1.25) == 5
    assert expert_capacity(8, 4, 2, None) is None
    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    # first choices in token order (0, 0, 0, 1), then second choices (1, 2, 1, 0): expert 0's 4th is dropped
    assert keep_within_capacity(experts, 3, 3).tolist() == [[True, True], [True, True], [True, True], [True, False]]
    # two slots: token 2's first choice is expert 0's third; its second, expert 1's third
    assert keep_within_capacity(experts, 3, 2).tolist() == [[True, True], [True, True], [False, False], [True, False]]
    assert keep_within_capacity(experts, 3, None).all()


def test_balancing_loss_by_hand():
    probs = torch.tensor([[0.75, 0.25], [0.5, 0.5]])
    # f = (1, 0) (both tokens chose expert 0), P = (0.625, 0.375): 2 · (1 · 0.625 + 0 · 0.375)
    assert float(load_balancing_loss(probs, torch.tensor([[0], [0]]))) == pytest.approx(1.25)
    # f = (1/2, 1/2): 2 · (0.5 · 0.625 + 0.5 · 0.375) = 1, the loss of perfect balance
    assert float(load_balancing_loss(probs, torch.tensor([[0], [1]]))) == pytest.approx(1.0)
    uniform = torch.full((6, 3), 1 / 3)
    assert float(load_balancing_loss(uniform, torch.tensor([[0, 1], [1, 2], [2, 0]] * 2))) == pytest.approx(1.0)
    assert tokens_per_expert(torch.tensor([[0, 1], [1, 2]]), 4).tolist() == [1, 2, 1, 0]
    assert tokens_per_rank(torch.tensor([1, 2, 1, 0]), 2).tolist() == [3, 1]
    assert imbalance(torch.tensor([3, 1])) == 1.5


@pytest.mark.parametrize("capacity_factor", [None, 1.0, 3.0])  # no limit, capacity = every token, more
def test_one_expert_top_1_no_drops_is_the_dense_mlp_exactly(capacity_factor):
    model = build_model("tiny", 64, seed=3)
    mlp = model.transformer.h[0].mlp
    moe = MoE(64, 256, MoEConfig(n_experts=1, top_k=1, capacity_factor=capacity_factor))
    moe.experts[0] = Expert.from_mlp(mlp)
    x = torch.randn(2, 5, 64)
    assert torch.equal(moe(x), mlp(x)) and moe.last.dropped == 0


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_the_mixture_gpt2_with_one_expert_top_1_is_the_dense_gpt2_exactly(capacity_factor):
    """Every block's MLP swapped for one expert holding its weights, top-1, nothing dropped: the same logits and
    the same gradients, bit for bit (the router's weight is softmax over one expert: exactly 1)."""
    from parallel_lib.expert_parallel import moe_gpt2

    dense = build_model("tiny", 64, seed=3)
    moe = moe_gpt2(build_model("tiny", 64, seed=3), MoEConfig(n_experts=1, top_k=1, capacity_factor=capacity_factor))
    for block, dense_block in zip(moe.transformer.h, dense.transformer.h):
        block.mlp.experts[0] = Expert.from_mlp(dense_block.mlp)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    logits, dense_logits = moe(ids[:, :-1]), dense(ids[:, :-1])
    assert torch.equal(logits, dense_logits)
    moe.loss(logits, ids[:, 1:]).backward()
    dense.loss(dense_logits, ids[:, 1:]).backward()
    moe_grads = dict(moe.named_parameters())
    for name, p in dense.named_parameters():
        name = name.replace(".mlp.", ".mlp.experts.0.")
        assert torch.equal(moe_grads[name].grad, p.grad), name
    assert all(float(b.mlp.aux_loss.detach()) == 1.0 for b in moe.transformer.h)  # one expert: perfect balance


def test_the_layer_sums_each_kept_choice_weighted_and_the_shared_expert():
    config = MoEConfig(n_experts=4, top_k=2, capacity_factor=0.5, shared_expert=True, normalize=True)
    moe = MoE(8, 16, config, token_groups=2, seed=1)
    x = torch.randn(3, 4, 8)
    y = moe(x)
    record = moe.last
    assert record.capacity == 2 and record.dropped > 0  # ceil(0.5 · 6 · 2 / 4)
    flat = x.reshape(-1, 8)
    for t in range(12):  # token by token, the sum the module docstring states
        expected = moe.shared_expert(flat[t])
        for j in range(2):
            if record.kept[t, j]:
                expected = expected + record.weights[t, j] * moe.experts[int(record.experts[t, j])](flat[t])
        torch.testing.assert_close(y.reshape(-1, 8)[t], expected, rtol=0, atol=1e-6)
    # capacity per group of 6 tokens: no expert keeps more than 2 choices of a group
    for half in (slice(0, 6), slice(6, 12)):
        assert tokens_per_expert(record.experts[half], 4, record.kept[half]).max() <= 2
    assert torch.equal(aux_loss_of(torch.nn.Sequential(moe)).detach(), record.aux_loss.detach())


def test_the_balancing_loss_spreads_a_skewed_router():
    """A router that sends 63 of 64 tokens to expert 0, trained on the balancing loss alone: counts over steps."""
    moe = MoE(16, 32, MoEConfig(n_experts=4, top_k=1), seed=0)
    with torch.no_grad():
        moe.router.gate.weight[0] += 0.3  # tokens lean towards +0.5 everywhere: expert 0 scores highest
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1)) + 0.5
    optimizer = torch.optim.SGD(moe.router.parameters(), lr=0.03)
    counts, losses = [], []
    for _ in range(30):
        optimizer.zero_grad()
        moe(x)
        counts.append(moe.last.tokens_per_expert)
        losses.append(float(moe.aux_loss.detach()))
        moe.aux_loss.backward()
        optimizer.step()
    assert counts[0].tolist() == [63, 0, 0, 1] and losses[0] > 2.9
    assert [imbalance(c) for c in counts[-3:]] == pytest.approx([1.2] * 3, abs=0.3)
    assert losses[-1] == pytest.approx(1.0, abs=0.02)  # 1 is perfect balance


def test_traffic_formula_by_hand():
    t = ep_traffic(tokens=8, top_k=2, hidden=16, n_experts=4, ep=2)
    assert (t.calls_forward, t.calls_backward) == (3, 2)
    assert t.row_bytes == 8 * 2 * 16 * 4 == 1024 and t.count_bytes == 32
    assert t.message_bytes == 4 * 1024 + 32 and t.wire_bytes == (4 * 1024 + 32) / 2
    assert ep_traffic(8, 2, 16, 4, 4, dtype_bytes=2).wire_bytes == (4 * 512 + 32) * 3 / 4
    experts, kept = torch.tensor([[0, 3], [1, 2]]), torch.tensor([[True, True], [True, False]])
    assert rows_leaving(experts, kept, 4, 2, 0) == 1 and rows_leaving(experts, kept, 4, 2, 1) == 2


def test_bad_input_is_refused_naming_the_argument():
    with pytest.raises(ValueError, match="top_k must be an int in 1..4"):
        MoEConfig(n_experts=4, top_k=5)
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        MoEConfig(capacity_factor=0.0)
    with pytest.raises(TypeError, match="shared_expert must be a bool"):
        MoEConfig(shared_expert=1)
    with pytest.raises(TypeError, match="config must be a MoEConfig"):
        MoE(8, 16, {"n_experts": 4})
    with pytest.raises(ValueError, match="token_groups=3 must divide the 8 tokens"):
        MoE(8, 16, MoEConfig(), token_groups=3)(torch.randn(8, 8))
    with pytest.raises(RuntimeError, match="run the layer first"):
        MoE(8, 16, MoEConfig()).aux_loss
    with pytest.raises(ValueError, match="no mixture-of-experts layer"):
        aux_loss_of(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="mlp must be the one GPT-2's MLP"):
        Expert.from_mlp(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="ep=3 must divide the number of experts"):
        tokens_per_rank(torch.zeros(4), 3)
    with pytest.raises(ValueError, match="logits must be"):
        top_k_route(torch.zeros(3), 1)


def test_moe_gpt2_swaps_every_mlp_and_refuses_twice():
    from parallel_lib.expert_parallel import moe_gpt2, parallelize_ep

    model = moe_gpt2(build_model("tiny", 64), MoEConfig(n_experts=2, top_k=1))
    assert all(isinstance(b.mlp, MoE) for b in model.transformer.h)
    logits = model(torch.randint(0, 64, (2, 6)))
    assert logits.shape == (2, 6, 64) and aux_loss_of(model).shape == ()
    with pytest.raises(ValueError, match="block 0's mlp is already a MoE"):
        moe_gpt2(model, MoEConfig())
    with pytest.raises(ValueError, match="block 0's mlp is a MLP, not a MoE: call moe_gpt2"):
        parallelize_ep(build_model("tiny", 64), None)
    with pytest.raises(TypeError, match="model must be the one GPT2"):
        parallelize_ep(torch.nn.Linear(2, 2), None)
    with pytest.raises(TypeError, match="config must be a MoEConfig"):
        moe_gpt2(build_model("tiny", 64), {"n_experts": 2})


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 0, 0]])  # an idle expert; no rows at all
def test_one_grouped_multiply_equals_the_loop_over_experts(counts):
    from parallel_lib.expert_parallel import run_experts

    experts = MoE(8, 16, MoEConfig(n_experts=4), seed=2).experts
    with torch.no_grad():
        for e in experts:
            e.c_fc.bias.normal_()
    expert_of_row = torch.arange(4).repeat_interleave(torch.tensor(counts))
    expert_of_row = expert_of_row[torch.randperm(len(expert_of_row))]
    rows = torch.randn(len(expert_of_row), 8, requires_grad=True)
    results = {}
    for how in ("loop", "grouped"):
        experts.zero_grad(set_to_none=True)
        rows.grad = None
        out = run_experts(experts, rows, expert_of_row, how)
        out.pow(2).sum().backward()  # backward even with no rows: the experts' weights are in the graph
        grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in experts.parameters()]
        results[how] = out.detach(), torch.zeros_like(rows) if rows.grad is None else rows.grad.clone(), grads
    for expected, got in zip(results["loop"][:2], results["grouped"][:2]):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    for expected, got in zip(results["loop"][2], results["grouped"][2]):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    if len(expert_of_row):  # and the loop is what it says: row 0 through its expert
        torch.testing.assert_close(results["loop"][0][0], experts[int(expert_of_row[0])](rows[0]).detach())
    with pytest.raises(ValueError, match="how must be one of"):
        run_experts(experts, rows, expert_of_row, "fused")


def test_one_rank_holds_every_expert_and_computes_the_layer(one_rank_group):
    import torch.distributed as dist

    from parallel_lib.expert_parallel import ExpertParallelMoE, all_to_all, exchange_counts

    config = MoEConfig(n_experts=4, top_k=2, capacity_factor=1.0, shared_expert=True)
    x = torch.randn(12, 8)
    layer = ExpertParallelMoE(MoE(8, 16, config, seed=4), dist.group.WORLD, expert_compute="grouped")
    torch.testing.assert_close(layer(x), MoE(8, 16, config, seed=4)(x), rtol=0, atol=1e-6)
    assert layer.received == int(layer.last.kept.sum()) and layer.local == 4
    with pytest.raises(ValueError, match=r"send and receive must hold one size per rank of the group \(1\)"):
        all_to_all(x, [6, 6], [12], dist.group.WORLD)
    with pytest.raises(ValueError, match=r"send=\[10\] sums to 10 rows but x has 12"):
        all_to_all(x, [10], [10], dist.group.WORLD)
    with pytest.raises(ValueError, match="timeout must be"):
        exchange_counts(torch.zeros(4, dtype=torch.int64), dist.group.WORLD, timeout=0)
    with pytest.raises(ValueError, match="expert_compute must be one of"):
        ExpertParallelMoE(MoE(8, 16, config), dist.group.WORLD, expert_compute="fused")
    with pytest.raises(TypeError, match="moe must be a MoE"):
        ExpertParallelMoE(torch.nn.Linear(2, 2), dist.group.WORLD)
