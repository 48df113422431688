"""The planner learns expert parallelism: a mixture model's parameters and model state on a layout with ep equal the
cost model's (Mixtral 8x7B), the all-to-all priced only when experts are split, and the search choosing EP."""

from __future__ import annotations

import pytest

from parallel_lib.cost import MIXTRAL_8X7B, moe_memory
from parallel_lib.planner.experts import Experts, mlp_parameters, plan_ep, price_ep
from parallel_lib.planner.hardware import GPUS, published_calibration
from parallel_lib.planner.layout import Layout, StepCost
from parallel_lib.cost.shape import GPTShape

# Mixtral 8x7B's dense skeleton (Mistral 7B's block, one expert as its MLP), and its mixture
MIXTRAL = GPTShape(32, 4096, 32, 32000, 4096, ffn_hidden=14336, kv_heads=8, gated_mlp=True, rms_norm=True,
                   bias=False, learned_positions=False, tied_head=False)
EXPERTS = Experts(n_experts=8, top_k=2)
CAL, COST = published_calibration("H100"), StepCost(0.0, GPUS["H100"].flops_bf16)


def test_a_mixture_layout_holds_what_the_cost_model_counts():
    assert mlp_parameters(MIXTRAL) == MIXTRAL_8X7B.expert_parameters == 3 * 4096 * 14336
    whole = price_ep(Layout(dp=16, zero=1, dtype="bf16"), 1, MIXTRAL, EXPERTS, 64, 4096, CAL, COST)
    assert whole.params == MIXTRAL_8X7B.parameters()
    split = price_ep(Layout(dp=16, zero=1, dtype="bf16"), 8, MIXTRAL, EXPERTS, 64, 4096, CAL, COST)
    assert split.params == MIXTRAL_8X7B.rank_parameters(8) and split.expert_params == 32 * 14336 * 4096 * 3
    assert split.state_bytes == pytest.approx(moe_memory(MIXTRAL_8X7B, ep=8, dp=16, zero=1)["total"], rel=1e-12)
    assert whole.all_to_all == 0 < split.all_to_all  # nothing to send when every rank holds every expert
    # two all-to-alls forward, two backward, per block: 4 sequences of 4096 per rank, top-2, 4096 wide, bf16
    assert split.all_to_all_bytes == 32 * (4 * 4 * 4096 * 2 * 4096 * 2 + 8 * 8)
    assert split.compute == pytest.approx(whole.compute) and whole.compute > whole.dense.compute  # top-2 > dense
    assert split.dp_comm < whole.dp_comm  # each expert's gradient over 2 copies instead of 16


def test_the_planner_chooses_expert_parallelism_for_mixtral_on_16_h100s():
    plan = plan_ep(MIXTRAL, EXPERTS, 16, GPUS["H100"].memory_bytes, 64, 4096, CAL, COST, schedules=("1f1b",),
                   zero_stages=(1, 3), recompute=(True,))
    assert plan.best.ep == 8 and plan.best.name == "DP16 ZeRO-1, recompute, EP8"
    # without EP, ZeRO-1 keeps 4 bytes of every one of the 46.7B parameters on each GPU: 174 GiB, no fit
    assert not [p for p in plan.ranked if p.ep == 1 and p.layout.zero == 1 and p.layout.tp == p.layout.pp == 1]
    assert all(p.memory_bytes <= GPUS["H100"].memory_bytes for p in plan.ranked)
    assert [p.step_seconds for p in plan.ranked] == sorted(p.step_seconds for p in plan.ranked)


def test_bad_ep_is_refused_by_name():
    with pytest.raises(ValueError, match="ep=3 must divide dp=16 and n_experts=8"):
        price_ep(Layout(dp=16), 3, MIXTRAL, EXPERTS, 64, 4096, CAL, COST)
    with pytest.raises(ValueError, match="top_k must be an int in 1..8"):
        Experts(8, 9)
