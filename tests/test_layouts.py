"""Every layout equals one process: the headline proof of the one training entry.

Each plan (DP with ZeRO 0-3 or chapter 01's averagers, TP with and without sequence parallelism,
PP with GPipe and 1F1B, with and without recomputation, and their combinations up to 8 ranks) trains the tiny
GPT-2 for two AdamW steps; every parameter, gathered by its dense name from the ranks that
hold it, must equal what one process reaches on the same global batches.

AdamW's update hardly depends on the gradient's scale (m / sqrt(v)), so a layout that doubled
or halved its gradients would pass with the usual eps = 1e-8. The runs use eps = 1e-3, larger
than most gradient entries of this model, so a wrong scale moves the parameters:
``test_a_wrong_gradient_scale_is_caught`` shows it does.

One launch per world size, every plan of that size in it (starting ranks is the slow part).
"""

from __future__ import annotations

import pytest
import torch

from parallel_lib.runtime import launch
from parallel_lib.training import Plan, RunConfig, reference, train_many

RUN = RunConfig(eps=1e-3, lr=1e-2)  # a large eps: the update depends on the gradient's scale

LAYOUTS: dict[int, list[Plan]] = {
    2: [Plan(dp=2), Plan(dp=2, zero=1), Plan(dp=2, zero=2), Plan(dp=2, zero=3),
        Plan(tp=2), Plan(tp=2, sequence_parallel=True),
        Plan(pp=2, schedule="gpipe"), Plan(pp=2, schedule="1f1b", recompute=True)],
    4: [Plan(dp=2, tp=2, zero=1), Plan(dp=2, tp=2, zero=1, sequence_parallel=True), Plan(dp=2, tp=2, zero=3),
        Plan(dp=2, pp=2, zero=2), Plan(dp=2, pp=2, zero=3, schedule="gpipe"),
        Plan(tp=2, pp=2, recompute=True), Plan(tp=2, pp=2, sequence_parallel=True, schedule="gpipe"),
        # chapter 01's averagers over the dp axis of a split model (one backward per step: micro_batches=1)
        Plan(dp=2, tp=2, sequence_parallel=True, sync="bucketed", micro_batches=1),
        Plan(dp=2, pp=2, sync="ddp", micro_batches=1)],
    8: [Plan(dp=2, tp=2, pp=2, zero=1, sequence_parallel=True),
        Plan(dp=2, tp=2, pp=2, zero=3, schedule="gpipe", recompute=True)],
}
CASES = [(world, k) for world, plans in LAYOUTS.items() for k in range(len(plans))]


@pytest.fixture(scope="module")
def expected() -> tuple[list[float], dict[str, torch.Tensor]]:
    return reference(RUN)


@pytest.fixture(scope="module")
def launched() -> dict[int, list[list]]:
    """world size -> per plan, every rank's TrainResult."""
    out = {}
    for world, plans in LAYOUTS.items():
        per_rank = launch(train_many, world, [(plan, RUN) for plan in plans], timeout=600, startup_timeout=300)
        out[world] = [[results[k] for results in per_rank] for k in range(len(plans))]
    return out


def test_at_least_twelve_layouts_are_proved():
    assert len(CASES) >= 12


@pytest.mark.parametrize("world, k", CASES, ids=[f"{w}:{LAYOUTS[w][k].name}" for w, k in CASES])
def test_every_layout_equals_one_process(launched, expected, world, k):
    results = launched[world][k]
    losses, state = expected
    shares = [r.record.losses for r in results if r.coords["pp"] == LAYOUTS[world][k].pp - 1 and r.coords["tp"] == 0]
    assert len(shares) == LAYOUTS[world][k].dp  # one last stage per replica: its share of the global loss
    assert [sum(step) for step in zip(*shares)] == pytest.approx(losses, rel=1e-5)
    trained: dict[str, torch.Tensor] = {}
    for r in results:
        for name, tensor in r.state.items():
            if name in trained:  # every replica ends with the same parameters
                torch.testing.assert_close(tensor, trained[name], atol=1e-6, rtol=0, msg=name)
            trained[name] = tensor
    assert set(trained) | {"lm_head.weight"} >= {k for k in state if not k.endswith((".attn.bias", "masked_bias"))}
    for name, tensor in trained.items():
        torch.testing.assert_close(tensor, state[name], atol=1e-6, rtol=0, msg=f"{LAYOUTS[world][k].name}: {name}")


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
