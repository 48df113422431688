"""Every layout equals one process: the headline proof of the one training entry.

Each plan (DP with ZeRO 0-3 or chapter 01's averagers, TP with and without sequence parallelism,
PP with GPipe and 1F1B, with and without recomputation, CP with the zig-zag and the contiguous
split, EP over the experts of chapter 12's mixture, and their combinations up to 8 ranks) trains the
tiny GPT-2 (the mixture-of-experts GPT-2 for EP) for two AdamW steps; every parameter, gathered by
its dense name from the ranks that hold it, must equal what one process reaches on the same global
batches.

AdamW's update hardly depends on the gradient's scale (m / sqrt(v)), so a layout that doubled
or halved its gradients would pass with the usual eps = 1e-8. The runs use eps = 1e-3, larger
than most gradient entries of this model, so a wrong scale moves the parameters:
``test_a_wrong_gradient_scale_is_caught`` shows it does.

One launch per world size, every plan of that size in it (starting ranks is the slow part).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from parallel_lib.runtime import launch
from parallel_lib.training import Plan, RunConfig, reference, train_many
from parallel_lib.training.run import check_layout

RUN = RunConfig(eps=1e-3, lr=1e-2)  # a large eps: the update depends on the gradient's scale
# chapter 12's mixture: 4 experts, top-2; with a capacity of half the fair share, choices are dropped (the
# reference then routes in the ranks' groups: one per replica and micro-batch)
MOE = replace(RUN, experts=4, top_k=2)
DROPPING = replace(MOE, capacity_factor=0.5)
RUNS = {MOE: "moe", DROPPING: "moe dropping"}

LAYOUTS: dict[int, list[Plan | tuple[Plan, RunConfig]]] = {  # a plan alone trains RUN
    2: [Plan(dp=2), Plan(dp=2, zero=1), Plan(dp=2, zero=2), Plan(dp=2, zero=3),
        Plan(tp=2), Plan(tp=2, sequence_parallel=True),
        Plan(pp=2, schedule="gpipe"), Plan(pp=2, schedule="1f1b", recompute=True),
        Plan(cp=2), Plan(cp=2, cp_layout="contiguous"), (Plan(ep=2), DROPPING)],
    4: [Plan(dp=2, tp=2, zero=1), Plan(dp=2, tp=2, zero=1, sequence_parallel=True), Plan(dp=2, tp=2, zero=3),
        Plan(dp=2, pp=2, zero=2), Plan(dp=2, pp=2, zero=3, schedule="gpipe"),
        Plan(tp=2, pp=2, recompute=True), Plan(tp=2, pp=2, sequence_parallel=True, schedule="gpipe"),
        # chapter 01's averagers over the dp axis of a split model (one backward per step: micro_batches=1)
        Plan(dp=2, tp=2, sequence_parallel=True, sync="bucketed", micro_batches=1),
        Plan(dp=2, pp=2, sync="ddp", micro_batches=1),
        Plan(dp=2, cp=2, zero=1), Plan(tp=2, cp=2), (Plan(dp=2, ep=2, zero=2), MOE)],
    8: [Plan(dp=2, tp=2, pp=2, zero=1, sequence_parallel=True),
        Plan(dp=2, tp=2, pp=2, zero=3, schedule="gpipe", recompute=True)],
}
JOBS: dict[int, list[tuple[Plan, RunConfig]]] = {
    world: [job if isinstance(job, tuple) else (job, RUN) for job in jobs] for world, jobs in LAYOUTS.items()}
CASES = [(world, k) for world, jobs in JOBS.items() for k in range(len(jobs))]


def _name(plan: Plan, run: RunConfig) -> str:
    return plan.name + (f" {RUNS[run]}" if run in RUNS else "")


@pytest.fixture(scope="module")
def expected() -> tuple[list[float], dict[str, torch.Tensor]]:
    return reference(RUN)


def _reference(plan: Plan, run: RunConfig, expected):
    """One process's losses and parameters for ``plan``'s run (a mixture routes in the plan's groups)."""
    if run == RUN:
        return expected
    return reference(run, dp=plan.row_replicas, micro_batches=plan.micro_batches)


@pytest.fixture(scope="module")
def launched() -> dict[int, list[list]]:
    """world size -> per plan, every rank's TrainResult."""
    out = {}
    for world, jobs in JOBS.items():
        per_rank = launch(train_many, world, jobs, timeout=600, startup_timeout=300)
        out[world] = [[results[k] for results in per_rank] for k in range(len(jobs))]
    return out


def test_at_least_twelve_layouts_are_proved():
    assert len(CASES) >= 12


@pytest.mark.parametrize("world, k", CASES, ids=[f"{w}:{_name(*JOBS[w][k])}" for w, k in CASES])
def test_every_layout_equals_one_process(launched, expected, world, k):
    results = launched[world][k]
    plan, run = JOBS[world][k]
    losses, state = _reference(plan, run, expected)
    shares = [r.record.losses for r in results if r.coords["pp"] == plan.pp - 1 and r.coords["tp"] == 0]
    assert len(shares) == plan.replicas  # one last stage per replica (and cp or ep rank): its share of the loss
    assert [sum(step) for step in zip(*shares)] == pytest.approx(losses, rel=1e-5)
    trained: dict[str, torch.Tensor] = {}
    for r in results:
        for name, tensor in r.state.items():
            if name in trained:  # every replica ends with the same parameters
                torch.testing.assert_close(tensor, trained[name], atol=1e-6, rtol=0, msg=name)
            trained[name] = tensor
    assert set(trained) | {"lm_head.weight"} >= {k for k in state if not k.endswith((".attn.bias", "masked_bias"))}
    for name, tensor in trained.items():
        torch.testing.assert_close(tensor, state[name], atol=1e-6, rtol=0, msg=f"{_name(plan, run)}: {name}")


def test_ring_attention_and_the_experts_run_on_their_axes(launched):
    """cp: the ring's messages on "cp", the gradients' mean on the flattened (dp, cp) group ("dp");
    ep: each rank holds only its experts (every expert on one rank), the dispatch's all-to-alls on "ep"."""
    def job(world, plan):
        return next(launched[world][k] for k, (p, _) in enumerate(JOBS[world]) if p == plan)

    for r in job(4, Plan(dp=2, cp=2, zero=1)):
        assert r.traffic["cp"]["send"][0] > 0 and r.traffic["dp"]["reduce_scatter"][0] > 0, r.traffic
        assert "other" not in r.traffic, r.traffic
    for world, plan in ((2, Plan(ep=2)), (4, Plan(dp=2, ep=2, zero=2))):
        results = job(world, plan)
        held = {}
        for r in results:
            assert r.traffic["ep"]["all_to_all"][0] > 0 and "other" not in r.traffic, r.traffic
            held.setdefault(r.coords["dp"], []).append({n for n in r.state if ".experts." in n})
        for ranks in held.values():  # within a replica: the ep ranks' experts are disjoint and cover all 4
            assert not set.intersection(*ranks) and len(set.union(*ranks)) == 4 * 4 * 4, [len(e) for e in ranks]
    from parallel_lib.training import build_model
    from parallel_lib.training.experts import mixture_of_experts

    counts = {True: 0, False: 0}  # the one-process mixture's elements: in experts, elsewhere
    for name, p in mixture_of_experts(build_model(MOE), MOE).named_parameters():
        counts[".experts." in name] += p.numel()
    for r in job(2, Plan(ep=2)):  # ZeRO-0: the optimizer steps everything but the other rank's experts
        assert r.num_parameters == counts[False] + counts[True] // 2, (r.num_parameters, counts)


def test_the_dropping_mixture_drops_choices():
    """The DROPPING run's capacity drops choices in every layer (else its grouped reference proves nothing)."""
    from parallel_lib.training import build_model, global_batches
    from parallel_lib.training.experts import mixture_of_experts

    model = mixture_of_experts(build_model(DROPPING), DROPPING, token_groups=4)
    model(global_batches(DROPPING)[0]["input_ids"])
    assert all(block.mlp.last.dropped > 0 for block in model.transformer.h)


@pytest.mark.parametrize("plan, run, match", [
    (Plan(cp=2, pp=2), RUN, "cp=2 with pipeline parallelism"),
    (Plan(cp=2), replace(RUN, seq_len=18), "seq_len must be divisible by 4"),
    (Plan(cp=2), replace(RUN, dropout=0.1), "cp=2 needs dropout=0.0"),
    (Plan(cp=2, tp=2, sequence_parallel=True), RUN, "sequence_parallel with cp"),
    (Plan(cp=2, ep=2), MOE, "cp=2 with ep=2"),
    (Plan(cp=2, sync="ddp", micro_batches=1), RUN, "needs sync='zero'"),
    (Plan(cp=2, cp_layout="striped"), RUN, "cp_layout"),
    (Plan(ep=2), RUN, "set experts"),
    (Plan(ep=4), replace(MOE, experts=6), "ep=4 must divide experts=6"),
    (Plan(ep=2, tp=2), MOE, "ep=2 with tp=2"),
    (Plan(ep=2, zero=3), MOE, "ep=2 with zero=3"),
    (Plan(ep=2), replace(MOE, max_grad_norm=1.0), "max_grad_norm with ep=2"),
    (Plan(ep=2), replace(MOE, freeze=("transformer.wpe.weight",)), "freeze with ep=2"),
    (Plan(tp=2), MOE, "experts=4 with tp=2"),
    (Plan(ep=2), replace(MOE, top_k=5), "top_k"),
    (Plan(ep=2), replace(MOE, batch_size=6), "batch_size must split into dp=1 x ep=2"),
])
def test_cp_and_ep_layouts_that_cannot_run_are_refused(plan, run, match):
    with pytest.raises(ValueError, match=match):
        check_layout(plan, run, plan.mesh.world_size)


def test_a_wrong_gradient_scale_is_caught(expected):
    """One process whose gradients are twice too large (a replica that forgot to divide by dp) ends
    further from the reference than the layouts' tolerance: with eps = 1e-3 AdamW sees the scale."""
    import torch.nn.functional as F

    from parallel_lib.training import build_model, global_batches

    model = build_model(RUN)
    optimizer = torch.optim.AdamW(model.parameters(), lr=RUN.lr, eps=RUN.eps, weight_decay=RUN.weight_decay)
    for batch in global_batches(RUN):
        optimizer.zero_grad()
        ce = F.cross_entropy(model(batch["input_ids"]).logits.flatten(0, 1), batch["labels"].flatten(),
                             reduction="none")
        weights = batch["label_token_weights"].flatten()
        (2 * (ce * weights).sum() / weights.sum()).backward()
        optimizer.step()
    _, state = expected
    worst = max((p.detach() - state[name]).abs().max().item() for name, p in model.named_parameters())
    print(f"largest difference of a 2x gradient: {worst:.1e}")
    assert worst > 100 * 1e-6, worst  # the layouts must agree to 1e-6 (they reach 2e-7)
