"""Chapter 12's dispatch as data (expert_parallel.dispatch_plan) and the drawings replayed from it
(viz.expert_parallel): the plan by hand, the replay consistent with what the ranks computed, every stage drawn,
the widget stepping."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from parallel_lib.expert_parallel.dispatch_plan import dispatch_plan, receive_counts  # noqa: E402
from parallel_lib.viz.expert_parallel import (FRAMES, dispatch_widget, plot_imbalance, render_dispatch,  # noqa: E402
                                              replay_dispatch)


def test_the_plan_by_hand():
    experts = torch.tensor([[0, 3], [1, 2], [3, 0]])
    kept = torch.tensor([[True, True], [True, False], [True, True]])
    plan = dispatch_plan(experts, kept, 4, 2)
    # kept choices in token order: (0,0) e0, (0,1) e3, (1,0) e1, (2,0) e3, (2,1) e0; sorted by expert, stable
    assert list(zip(plan.token.tolist(), plan.slot.tolist())) == [(0, 0), (2, 1), (1, 0), (0, 1), (2, 0)]
    assert plan.expert.tolist() == [0, 0, 1, 3, 3] and plan.counts.tolist() == [2, 1, 0, 2] and plan.send == [3, 2]
    assert dispatch_plan(experts, kept, 4, 4).send == [2, 1, 0, 2]  # one expert per rank: the counts themselves
    other = torch.tensor([0, 0, 3, 1])
    assert receive_counts([plan.counts, other], 0).tolist() == [[2, 1], [0, 0]]
    assert receive_counts([plan.counts, other], 1).tolist() == [[0, 2], [3, 1]]


def test_bad_input_is_refused_naming_the_argument():
    experts, kept = torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match="ep=3 must divide n_experts=4"):
        dispatch_plan(experts, kept, 4, 3)
    with pytest.raises(ValueError, match=r"experts and kept must both be \(tokens, k\)"):
        dispatch_plan(experts, kept[:1], 4, 2)
    with pytest.raises(ValueError, match="ep_rank must be an int in 0..1"):
        receive_counts([torch.zeros(4), torch.zeros(4)], 2)


def test_the_plan_is_what_the_layer_sends_on_one_rank(one_rank_group):
    import torch.distributed as dist

    from parallel_lib.expert_parallel import ExpertParallelMoE, MoE, MoEConfig
    layer = ExpertParallelMoE(MoE(8, 16, MoEConfig(n_experts=4, top_k=2, capacity_factor=0.75), seed=2),
                              dist.group.WORLD)
    layer(torch.randn(10, 8))
    plan = dispatch_plan(layer.last.experts, layer.last.kept, 4, 1)
    assert plan.send == [layer.received] and layer.received == int(layer.last.kept.sum()) < 20


def _records():
    """Two ranks' routing of 3 tokens, top-2 over 4 experts; rank 1 had a choice dropped."""
    return [dict(experts=torch.tensor([[0, 2], [3, 1], [2, 0]]), kept=torch.ones(3, 2, dtype=torch.bool),
                 weights=torch.full((3, 2), 0.5)),
            dict(experts=torch.tensor([[1, 0], [0, 3], [2, 1]]),
                 kept=torch.tensor([[True, True], [True, False], [True, True]]), weights=torch.full((3, 2), 0.5))]


def test_the_replay_delivers_every_kept_choice_once_to_its_experts_rank():
    ranks = replay_dispatch(_records(), 4)
    assert [r["send"] for r in ranks] == [[3, 3], [4, 1]]
    assert [len(r["received"]) for r in ranks] == [3 + 4, 3 + 1]  # what every rank sends it
    assert ranks[0]["received"][:3] == [(0, 0, 0, 0), (0, 2, 1, 0), (0, 1, 1, 1)]  # rank 0's own rows first
    assert all(e // 2 == rank for rank, r in enumerate(ranks) for _, _, _, e in r["received"])


def test_every_stage_draws_and_the_widget_steps_through_them():
    for frame in range(len(FRAMES)):
        fig = render_dispatch(_records(), 4, frame)
        assert fig.axes[0].get_title(loc="left").startswith(f"stage {frame + 1}/{len(FRAMES)}")
        plt.close(fig)
    with pytest.raises(ValueError, match="frame must be an int in 0..4"):
        render_dispatch(_records(), 4, 5)
    pytest.importorskip("ipywidgets")
    widget = dispatch_widget(_records(), 4)
    widget.children[0].children[1].value = 2
    assert "all-to-all" in widget.children[1].value


def test_the_imbalance_plot_reads_the_log():
    log = dict(routed=[[[4, 0, 0, 0]], [[1, 1, 1, 1]]], received=[[4], [2]])
    other = dict(routed=[[[0, 0, 0, 0]], [[1, 1, 1, 1]]], received=[[0], [2]])
    fig = plot_imbalance({0.0: [log, other], 0.1: [log, other]}, title="t")
    left, right = fig.axes
    assert list(left.lines[0].get_ydata()) == [4.0, 1.0]  # busiest expert / mean over both ranks' choices
    assert list(right.lines[0].get_ydata()) == [2.0, 1.0]  # busiest rank's rows / mean
    plt.close(fig)
