"""Expert parallelism on gloo ranks equals the one-process mixture layer, and its all-to-alls move what the
formula says: ep = 2 and 4, with and without dropped tokens, every check of one ``ep`` in one launch."""

from __future__ import annotations

import pytest
import torch

from parallel_lib.cost import gpt2_moe_shape, moe_memory
from parallel_lib.expert_parallel import ep_traffic, load_by_step, tokens_per_rank
from parallel_lib.expert_parallel.verify import BALANCE_RUN, HIDDEN, ep_checks
from parallel_lib.runtime import launch

CASES = [
    dict(n_experts=4, top_k=1),                                                     # Switch: nothing dropped
    dict(n_experts=4, top_k=2, capacity_factor=1.0, shared_expert=True),            # drops, DeepSeekMoE's shared
    dict(n_experts=8, top_k=2, capacity_factor=0.5, normalize=True,                 # many drops, Mixtral weights,
         expert_compute="grouped"),                                                 # one batched multiply
]
GPT2_CASES = [dict(n_experts=4, top_k=1), dict(n_experts=4, top_k=2, capacity_factor=1.0, shared_expert=True)]
TOKENS = 16  # per rank (verify.ep_matches_one_process's default)


@pytest.fixture(scope="module", params=[2, 4], ids=["ep2", "ep4"])
def ranks(request):
    ep = request.param  # the balancing-loss runs (two trainings of 8 steps) at ep = 2 only
    return ep, launch(ep_checks, ep, CASES, GPT2_CASES, 3, ep == 2, backend="gloo", timeout=180)


def test_outputs_gradients_and_adamw_steps_equal_one_process(ranks):
    ep, results = ranks
    for n, config in enumerate(CASES):
        cases = [r["cases"][n] for r in results]
        for rank, c in enumerate(cases):
            where = f"ep={ep} rank {rank} case {config}"
            assert c["output"] < 1e-6 and c["input_grad"] < 1e-6, where
            # 4 tensors per expert of this rank, the router, the shared expert
            assert len(c["grads"]) == 4 * (config["n_experts"] // ep) + 1 + (4 if config.get("shared_expert") else 0)
            assert max(c["grads"].values()) < 1e-5, (where, c["grads"])
            assert c["after_steps"] < 1e-5, where  # parameters after 3 AdamW steps
            assert c["counts"] == c["reference_counts"], where  # the same choices kept, expert by expert
        assert sum(c["my_aux_loss"] for c in cases) / ep == pytest.approx(cases[0]["aux_loss"], rel=1e-6)
        dropped = sum(c["dropped"] for c in cases)
        assert (dropped > 0) == ("capacity_factor" in config), (ep, config, dropped)


def test_parallelize_ep_gpt2_equals_the_one_process_moe_gpt2(ranks):
    ep, results = ranks
    for n, config in enumerate(GPT2_CASES):
        for rank, r in enumerate(results):
            g, where = r["gpt2"][n], f"ep={ep} rank {rank} {config}"
            assert g["logits"] < 1e-5, where
            assert len(g["grads"]) > 50 and max(g["grads"].values()) < 1e-6, (where, g["grads"])
            # AdamW turns gradient differences of ~1e-8 into updates of up to lr on near-zero gradients
            assert g["after_steps"] < 3e-5, where
        for step, reference in enumerate(results[0]["gpt2"][n]["reference_losses"]):
            assert sum(r["gpt2"][n]["losses"][step] for r in results) / ep == pytest.approx(reference, rel=1e-6)
        assert (sum(r["gpt2"][n]["dropped"] for r in results) > 0) == ("capacity_factor" in config)


def test_a_rank_that_receives_no_rows_still_meets_every_all_to_all(ranks):
    ep, results = ranks
    assert [r["idle"]["received"] for r in results] == [8 * ep] + [0] * (ep - 1)  # every token to expert 0
    assert results[0]["idle"]["expert_grad"] > 0 and all(r["idle"]["expert_grad"] == 0 for r in results[1:])
    assert all(r["idle"]["router_grad"] for r in results)


def test_the_routing_log_adds_up_what_every_rank_routed_to_what_each_rank_computed(ranks):
    ep, results = ranks
    logs = [r["log"] for r in results]
    for step in range(3):
        for layer in range(4):  # tiny GPT-2: 4 blocks
            routed = torch.tensor([log["routed"][step][layer] for log in logs]).sum(0)  # (E,) over every rank
            assert routed.sum() <= 2 * 2 * 16 * ep  # rows · seq · top_k per rank; capacity 1.0 may drop some
            assert [log["received"][step][layer] for log in logs] == tokens_per_rank(routed, ep).tolist()
    assert all(len(log["step_s"]) == 3 and min(log["step_s"]) > 0 for log in logs)


def test_all_to_all_bytes_equal_the_formula(ranks):
    ep, results = ranks
    formula = ep_traffic(tokens=TOKENS, top_k=2, hidden=HIDDEN, n_experts=2 * ep, ep=ep)
    for r in results:
        t = r["traffic"]  # balanced routing: every rank sends every rank the same rows
        assert t["forward_calls"] == formula.calls_forward and len(t["calls"]) == 3 + formula.calls_backward
        assert t["other_kinds"] == []
        assert sum(n for n, _ in t["calls"]) == formula.message_bytes
        assert sum(w for _, w in t["calls"]) == formula.wire_bytes
        assert t["leaving"] * HIDDEN * 4 == t["calls"][1][1]  # the rows that stay on the rank are not sent
    # with drops and imbalance: the dispatch sends each kept choice once, the combine returns what arrived
    dropped = [r["traffic_dropped"] for r in results]
    for t in dropped:
        assert len(t["calls"]) == 5 and t["kept"] < TOKENS * 2
        assert t["calls"][1][0] == t["calls"][3][0] == t["kept"] * HIDDEN * 4   # dispatch and its backward
        assert t["calls"][2][0] == t["calls"][4][0]                             # combine and its backward
    assert sum(t["calls"][2][0] for t in dropped) == sum(t["calls"][1][0] for t in dropped)  # every row returns


def test_bad_splits_and_absent_peers_are_named(ranks):
    ep, results = ranks
    for r in results:
        assert r["refusals"]["wrong_split"] == (f"ValueError: the ep group's {ep} ranks must divide "
                                                f"n_experts={2 * ep - 1}: each rank holds n/ep experts")
    assert results[0]["refusals"]["timeout"].startswith(
        "TimeoutError: rank 0 (rank 0 of its ep group): the all-to-all of counts: nothing within timeout=1 s")


def test_memory_per_rank_by_census_equals_the_formula(ranks):
    """The tiny mixture GPT-2 (2·ep experts, top-2, a shared expert) after an AdamW step: each rank holds everything
    replicated and E/ep experts of each layer, 4 + 4 + 8 bytes per parameter in fp32."""
    ep, results = ranks
    shape = gpt2_moe_shape(n_layer=4, n_embd=64, vocab_size=64, n_positions=128, n_experts=2 * ep, top_k=2,
                           shared_experts=1)
    formula = moe_memory(shape, ep, precision="fp32")
    for r in results:
        c = r["census"]
        assert c["parameters"] == shape.rank_parameters(ep) == formula["parameters"]
        assert (c["params"], c["grads"], c["moments"]) == (formula["params"], formula["grads"], formula["optimizer"])
    one_expert = 2 * 64 * 256 + 256 + 64  # c_fc and c_proj with their biases
    assert shape.rank_parameters(1) - shape.rank_parameters(ep) == 4 * (2 * ep - 2) * one_expert


def test_the_balancing_loss_keeps_measured_load_even_where_its_absence_lets_the_router_collapse(ranks):
    ep, results = ranks
    if ep != 2:
        pytest.skip("measured at ep = 2")
    without, with_loss = (load_by_step([r["balance"][aux] for r in results]) for aux in (0.0, 0.1))
    assert without[0]["per_expert"] == with_loss[0]["per_expert"]  # the same seeded start
    late = slice(-3, None)  # the last 3 of 8 steps, 4 layers each: busiest expert / mean, busiest rank / mean
    collapsed = [s["expert_imbalance"] for s in without[late]]
    balanced = [s["expert_imbalance"] for s in with_loss[late]]
    assert min(collapsed) > 2.5 and max(balanced) < 2.3, (collapsed, balanced)  # 4 experts: 4.0 is total collapse
    assert max(s["rank_imbalance"] for s in with_loss[late]) < min(s["rank_imbalance"] for s in without[late])
    assert without[-1]["expert_imbalance"] > without[0]["expert_imbalance"] + 1  # it grew with training
    for s in without + with_loss:  # what every rank's experts computed is what every rank routed to them
        assert sum(s["per_rank"]) == sum(s["per_expert"]) == 4 * ep * BALANCE_RUN["rows"] * BALANCE_RUN["seq"]
        assert s["step_s"] >= s["mean_step_s"] > 0 and s["busiest_expert_s"] > 0


def test_a_training_steps_counted_all_to_all_bytes_equal_the_formula(ranks):
    """Nothing dropped (no capacity limit): over the ranks, every step's counted all-to-all bytes are the formula's
    exactly, the tiny GPT-2's 4 mixture layers together, whatever the imbalance. Rank by rank, the dispatch and the
    backward of the combine send the rank's own T·k rows, the combine and the backward of the dispatch the rows its
    experts received: equal to the formula's share only when routing is balanced."""
    ep, results = ranks
    if ep != 2:
        pytest.skip("measured at ep = 2")
    tokens = BALANCE_RUN["rows"] * BALANCE_RUN["seq"]
    layer = ep_traffic(tokens=tokens, top_k=1, hidden=64, n_experts=2 * ep, ep=ep)
    for aux in (0.0, 0.1):
        for step in range(BALANCE_RUN["steps"]):
            counted = [r["balance"][aux]["all_to_all"][step] for r in results]
            assert all(calls == 4 * (layer.calls_forward + layer.calls_backward) for calls, _, _ in counted)
            assert sum(message for _, message, _ in counted) == ep * 4 * layer.message_bytes
            assert sum(wire for _, _, wire in counted) == ep * 4 * layer.wire_bytes
            for r, (_, message, _) in zip(results, counted):
                received = r["balance"][aux]["received"][step]  # per layer
                assert message == sum(2 * (tokens + n) * 64 * 4 + layer.count_bytes for n in received)
