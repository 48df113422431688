"""Chapter 10's planner pictures draw the planner's own numbers: bar lengths, the predicted step's span, the band."""

from __future__ import annotations

from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.collections import PathCollection  # noqa: E402

from parallel_lib.planner.hardware import GPUS, published_calibration  # noqa: E402
from parallel_lib.planner.layout import Layout, StepCost, price  # noqa: E402
from parallel_lib.viz.planner import (MODELS, measured_vs_predicted, memory_bars, predicted_events,  # noqa: E402
                                      published_plan)

SHAPE, SEQ = MODELS["GPT-2 XL 1.5B"]


def _priced(layout: Layout, batch: int = 64):
    return price(layout, SHAPE, batch, SEQ, published_calibration("A100"), StepCost(0.0, GPUS["A100"].flops_bf16))


@pytest.mark.parametrize("layout", [Layout(dp=4, pp=2, zero=1, micro_batches=8, dtype="bf16"),
                                    Layout(dp=8, zero=0, micro_batches=2, dtype="bf16"),
                                    Layout(dp=2, pp=4, schedule="interleaved", virtual=2, micro_batches=8,
                                           dtype="bf16")])
def test_the_predicted_step_spans_compute_then_collectives_and_optimizer_on_every_stage(layout):
    priced = _priced(layout)
    events = predicted_events(priced)
    work = [e for e in events if e.kind != "comm"]
    assert {e.lane for e in events} == {f"stage {j}" for j in range(layout.pp)}
    assert min(e.start for e in work) == 0.0
    assert max(e.end for e in work) == pytest.approx(priced.compute)
    forwards = [e for e in work if e.kind == "forward"]
    assert len(forwards) == layout.pp * layout.virtual * layout.micro_batches  # every micro-batch through every stage
    assert max(e.end for e in events) == pytest.approx(priced.step_seconds)
    dp = [e for e in events if e.label == "dp"]
    assert len(dp) == layout.pp and all(e.duration == pytest.approx(priced.dp_comm) for e in dp)


def test_memory_bars_draw_state_and_activations_in_gib_and_hatch_the_misfits():
    plan = published_plan("Llama 3 8B", "V100", 8, 64)  # 16 bytes per parameter: much does not fit
    shown = list(plan.ranked[:2]) + [c for c in plan.rejected if c.priced][:2]
    assert len(shown) == 4 and not shown[-1].fits
    fig = memory_bars(shown, plan.memory_per_device)
    bars = list(fig.axes[0].patches)
    # state, then activations, per layout (and between them ZeRO-3's gathered working set)
    assert len(bars) == 2 * len(shown) + sum(1 for c in shown if c.priced.working_bytes)
    for c in shown:
        state = bars.pop(0)
        working = bars.pop(0).get_width() if c.priced.working_bytes else 0.0
        acts = bars.pop(0)
        assert state.get_width() == pytest.approx(c.priced.state_bytes / 2**30)
        assert acts.get_x() == pytest.approx(state.get_width() + working)
        assert acts.get_width() == pytest.approx(c.priced.activation_bytes / 2**30)
        assert bool(state.get_hatch()) == (not c.fits)
    plt.close(fig)
    with pytest.raises(ValueError, match="candidates is empty"):
        memory_bars([], plan.memory_per_device)


def test_scatter_places_each_row_at_measured_predicted_and_refuses_no_rows():
    rows = [SimpleNamespace(layout=Layout(dp=2), predicted_seconds=0.01, measured_seconds=0.012),
            SimpleNamespace(layout=Layout(pp=2, micro_batches=4), predicted_seconds=0.03, measured_seconds=0.02)]
    fig = measured_vs_predicted(rows)
    points = [tuple(c.get_offsets()[0]) for c in fig.axes[0].collections if isinstance(c, PathCollection)]
    assert points == [pytest.approx((12.0, 10.0)), pytest.approx((20.0, 30.0))]
    plt.close(fig)
    with pytest.raises(ValueError, match="rows is empty"):
        measured_vs_predicted([])


def test_the_widget_refuses_an_unknown_model_or_gpu():
    with pytest.raises(ValueError, match="model"):
        published_plan("GPT-5", "H100", 8, 64)
    with pytest.raises(ValueError, match="gpu"):
        published_plan("GPT-2 XL 1.5B", "B200", 8, 64)


def test_the_widget_opens_on_the_static_figures_job_and_redraws_on_a_change():
    widgets = pytest.importorskip("ipywidgets")
    from parallel_lib.viz.planner import planner_widget

    panel = planner_widget()
    controls = [c for row in panel.children[:-1] for c in row.children]
    assert [c.value for c in controls] == ["Llama 3 8B", "H100", 64, 256]  # figures.py's planner_widget_ch10
    assert isinstance(panel.children[-1], widgets.Output)
    controls[2].value = 8  # redraws without raising
    plt.close("all")


def test_a_zero3_bar_shows_its_gathered_working_set_between_state_and_activations():
    from parallel_lib.planner.search import Candidate

    layouts = [Layout(dp=8, zero=3, dtype="bf16"), Layout(dp=8, zero=1, dtype="bf16")]
    shown = [Candidate(_priced(layout), layout) for layout in layouts]
    fig = memory_bars(shown, 80 * 2**30)
    state, working, acts, *others = fig.axes[0].patches
    assert len(others) == 2  # ZeRO-1: state and activations only
    assert working.get_x() == pytest.approx(state.get_width())
    assert working.get_width() == pytest.approx(shown[0].priced.working_bytes / 2**30) and working.get_width() > 0
    assert acts.get_x() == pytest.approx(state.get_width() + working.get_width())
    plt.close(fig)
