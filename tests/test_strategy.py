"""Tests for parallel_lib.planner.strategy (the planner), parallel_lib.planner.compare's pure parts and the widget.

The planner must agree with the formulas it is built from (memory, bubble, ring
all-reduce), pick sensibly, and refuse bad input with a message that names it.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from parallel_lib.common import build_gpt2  # noqa: E402
from parallel_lib.exercises import solutions  # noqa: E402
from parallel_lib.figures import collect  # noqa: E402
from parallel_lib.model_parallel import (  # noqa: E402
    MODEL_SHAPES,
    GiB,
    ModelShape,
    activation_memory,
    get_device_map,  # noqa: E402
    parallelize,  # noqa: E402
    training_memory,
)
from parallel_lib.pipeline_parallel import bubble_fraction  # noqa: E402
from parallel_lib.planner import (  # noqa: E402
    PART_ONE,
    STRATEGIES,
    Measured,
    fewest_stages,
    markdown_table,
    p2p_bytes,
    plan,
    ring_bytes,
)
from parallel_lib.planner.compare import _handover_bytes  # noqa: E402
from parallel_lib.viz.strategy import strategy_widget  # noqa: E402

GPT2 = MODEL_SHAPES["gpt2 (124M)"]
LLAMA_7B = MODEL_SHAPES["llama-2-7b"]


def test_small_model_on_many_gpus_is_plain_data_parallelism():
    chosen = plan("gpt2 (124M)", seq_len=1024, batch_size=32, gpu_gib=16, n_gpus=8)
    dp = chosen.option("DP")
    assert (dp.replicas, dp.stages, dp.bubble, dp.p2p_bytes) == (8, 1, 0.0, 0.0)
    expected_state = training_memory(GPT2.n_params, "fp16", "adamw").total
    expected_acts = activation_memory(4, 1024, GPT2.hidden, GPT2.n_heads, GPT2.n_layers, False)  # 32 / 8 sequences
    assert dp.state_bytes == expected_state and dp.activation_bytes == pytest.approx(expected_acts)
    grads = training_memory(GPT2.n_params, "fp16", "adamw").gradients
    assert dp.allreduce_bytes == pytest.approx(2 * 7 / 8 * grads)
    assert chosen.best is dp and "Pick: DP, 8 x 1" in chosen.explain()
    assert [o.strategy for o in chosen.options] == list(PART_ONE)


def test_7b_on_8_large_gpus_needs_pipelines_and_replicates_them():
    chosen = plan("llama-2-7b", seq_len=4096, batch_size=64, gpu_gib=80, n_gpus=8)
    assert not chosen.option("DP").feasible  # 100 GiB of training state on each GPU
    mp = chosen.option("MP")  # 12.5 GiB of state: fits once it accumulates over 3 micro-batches
    plain = plan("llama-2-7b", seq_len=4096, batch_size=64, gpu_gib=80, n_gpus=8, accumulate=False, recompute=False)
    assert mp.feasible and mp.micro_batches == 3 and not plain.option("MP").feasible
    pp, hybrid = chosen.option("PP"), chosen.option("DP×PP")
    assert (pp.replicas, pp.stages, pp.micro_batches) == (1, 8, 32)  # m = 4p
    assert pp.bubble == bubble_fraction(8, 32)
    assert (hybrid.replicas, hybrid.stages) == (2, 4) and hybrid.feasible
    assert chosen.best is hybrid  # a smaller bubble on as many GPUs
    assert chosen.option("MP").bubble == bubble_fraction(8, 1) == 7 / 8  # one micro-batch: one stage at a time
    # 1F1B: stage 0 keeps p = 8 micro-batches of 64 / 32 = 2 sequences, for its 32 / 8 blocks
    assert pp.activation_bytes == pytest.approx(activation_memory(16, 4096, 4096, 32, 4, False))
    assert "NOT feasible" in chosen.explain() and "> 80 GiB per GPU" in chosen.explain()


def test_gpipe_keeps_all_micro_batches_1f1b_only_p():
    kwargs = dict(seq_len=2048, batch_size=64, gpu_gib=80, n_gpus=4, micro_batches=16)
    gpipe, one_f_one_b = (plan("llama-2-7b", schedule=s, recompute=False, **kwargs).option("PP")
                          for s in ("gpipe", "1f1b"))
    assert gpipe.activation_bytes == pytest.approx(4 * one_f_one_b.activation_bytes)  # m = 16 vs p = 4
    assert gpipe.bubble == one_f_one_b.bubble


@pytest.mark.parametrize("model, seq_len, batch_size, gpu_gib, n_gpus", [
    ("llama-2-13b", 2048, 256, 40, 16), ("llama-2-7b", 4096, 64, 80, 8), ("llama-2-7b", 2048, 64, 16, 16),
    ("gpt2-xl (1.5B)", 1024, 64, 16, 8), ("llama-2-70b", 4096, 64, 80, 64), ("gpt2 (124M)", 1024, 32, 16, 8)])
def test_the_exercise_layout_is_the_planners_pick(model, seq_len, batch_size, gpu_gib, n_gpus):
    # chapter 05's exercise is handed plan.fits and checked against plan.layout; the DP×PP option
    # (or DP, with one stage) must be that same layout, so chapter, planner and checker agree
    chosen = plan(model, seq_len, batch_size, gpu_gib, n_gpus)
    solved = solutions.plan_parallelism(chosen.fits, n_gpus, MODEL_SHAPES[model].n_layers)
    assert solved == chosen.layout
    if solved is None:
        return
    stages, replicas = solved
    option = chosen.option("DP" if stages == 1 else "PP" if replicas == 1 else "DP×PP")
    assert (option.stages, option.replicas) == solved and option.feasible and not option.recompute
    assert all(not chosen.fits(fewer, n_gpus // fewer) for fewer in range(1, stages))


def test_the_llama_7b_layout_is_4_stages_by_2_replicas_everywhere():
    chosen = plan("llama-2-7b", seq_len=4096, batch_size=64, gpu_gib=80, n_gpus=8)
    assert chosen.layout == (4, 2) and chosen.fits(4, 2) and not chosen.fits(2, 4)
    assert not chosen.fits(4, 1)  # one replica keeps all 64 sequences' activations: too many
    assert fewest_stages(chosen.fits, 8, 32) == (4, 2)


def test_gpt2_xl_trains_on_one_80_gib_gpu_with_gradient_accumulation():
    plain = plan("gpt2-xl (1.5B)", 1024, 64, 80, 1, accumulate=False, recompute=False)
    assert plain.best is None  # 64 sequences' activations at once: 183 GiB
    chosen = plan("gpt2-xl (1.5B)", 1024, 64, 80, 1)
    dp = chosen.best
    xl = MODEL_SHAPES["gpt2-xl (1.5B)"]
    assert dp is chosen.option("DP") and dp.micro_batches == 3 and not dp.recompute  # 22 + 21 + 21 sequences
    assert dp.activation_bytes == pytest.approx(activation_memory(22, 1024, xl.hidden, xl.n_heads, 48, False))
    assert dp.memory_bytes <= 80 * GiB < chosen.inputs.cost("DP", 1, 1, 2).memory_bytes  # 2 would not do
    assert "gradient accumulation: 3 micro-batches" in chosen.explain()


def test_recomputation_is_the_last_resort_and_costs_a_quarter_of_the_compute():
    kwargs = dict(seq_len=2048, batch_size=64, gpu_gib=80, n_gpus=32)
    without = plan("llama-2-70b", recompute=False, **kwargs)
    chosen = plan("llama-2-70b", **kwargs)
    assert not without.option("PP").feasible and not without.option("DP×PP").feasible
    pp, hybrid = chosen.option("PP"), chosen.option("DP×PP")
    assert pp.feasible and pp.recompute and hybrid.feasible and hybrid.recompute
    shape = MODEL_SHAPES["llama-2-70b"]
    layers, held = shape.n_layers // 32 + (shape.n_layers % 32 > 0), 32  # 1F1B: p = 32 one-sequence micro-batches
    assert pp.activation_bytes == pytest.approx(activation_memory(held, 2048, shape.hidden, shape.n_heads, layers,
                                                                  False, recompute=True))
    assert pp.busy_devices == pytest.approx(32 * (1 - pp.bubble) * 0.75)
    assert chosen.layout is None  # the exercise's layout asks for a fit without recomputation
    # a layout that fits without recomputation never gets it
    assert not plan("llama-2-7b", 4096, 64, 80, 8).option("DP×PP").recompute


def test_recomputed_activations_keep_one_input_per_layer_and_one_full_layer():
    full = activation_memory(2, 1024, 768, 12, 12, False)
    recomputed = activation_memory(2, 1024, 768, 12, 12, False, recompute=True)
    assert recomputed == 12 * 2 * 2 * 1024 * 768 + full / 12
    assert recomputed < full / 5


def test_a_batch_smaller_than_the_gpus_limits_data_parallelism():
    dp = plan("gpt2 (124M)", 1024, batch_size=3, gpu_gib=16, n_gpus=8).option("DP")
    assert dp.replicas == 3 and "feeds only 3 of 8 GPUs" in " ".join(dp.reasons)
    pp = plan("gpt2 (124M)", 1024, batch_size=3, gpu_gib=16, n_gpus=8).option("PP")
    assert pp.micro_batches == 3  # at most one micro-batch per sequence


def test_one_gpu_cannot_be_split_and_more_gpus_than_blocks_leave_some_idle():
    chosen = plan("gpt2 (124M)", 1024, 8, 80, n_gpus=1)
    assert [o.feasible for o in chosen.options] == [True, False, False, False]
    assert "one GPU cannot be split into stages" in chosen.option("PP").reasons
    wide = plan("gpt2 (124M)", 1024, 64, 80, n_gpus=16).option("PP")
    assert wide.stages == 12 and any("4 GPU(s) idle" in r for r in wide.reasons)


def test_nothing_fits_says_so():
    chosen = plan("llama-2-70b", 4096, 64, 16, n_gpus=2)
    assert chosen.best is None and "No strategy fits" in chosen.explain()


def test_a_custom_shape_and_the_table():
    shape = ModelShape(n_params=10**9, n_layers=24, hidden=2048, n_heads=16, seq_len=2048)
    chosen = plan(shape, 2048, 16, 24, 4)
    assert chosen.model == "1.00 B parameters"
    lines = chosen.table().splitlines()
    assert len(lines) == 2 + len(PART_ONE) and lines[2].startswith("DP ")


def test_communication_helpers():
    assert ring_bytes(100.0, 1) == 0.0 and ring_bytes(100.0, 4) == 150.0
    assert [p2p_bytes(10.0, p) for p in (1, 2, 3, 8)] == [0.0, 10.0, 20.0, 20.0]


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(model="gpt-5"), ValueError, "model must be one of"),
    (dict(model=7), TypeError, "model must be a name or a ModelShape, got int"),
    (dict(seq_len=0), ValueError, "seq_len must be an int >= 1, got seq_len=0"),
    (dict(batch_size=2.5), ValueError, "batch_size must be an int >= 1"),
    (dict(n_gpus=True), ValueError, "n_gpus must be an int >= 1, got n_gpus=True"),
    (dict(micro_batches=0), ValueError, "micro_batches must be an int >= 1"),
    (dict(gpu_gib=0), ValueError, "gpu_gib must be > 0, got gpu_gib=0"),
    (dict(links="H200"), ValueError, "gpu must be one of"),
    (dict(links=25e9), TypeError, "links must be a GPU name"),
    (dict(dtype="int8"), ValueError, "dtype must be one of"),
    (dict(optimizer="lion"), ValueError, "optimizer must be one of"),
    (dict(schedule="zigzag"), ValueError, "schedule must be one of"),
])
def test_bad_inputs_name_the_argument(kwargs, error, match):
    args = {**dict(model="gpt2 (124M)", seq_len=1024, batch_size=8, gpu_gib=16, n_gpus=2), **kwargs}
    with pytest.raises(error, match=match):
        plan(**args)


def test_option_by_unknown_name():
    with pytest.raises(ValueError, match="strategy must be one of"):
        plan("gpt2 (124M)", 1024, 8, 16, 2).option("ZeRO")


def test_handover_bytes_follow_the_device_map():
    model = parallelize(build_gpt2("tiny", vocab_size=300), get_device_map(4, [0, 1]))
    # the tied head runs on device 0: hidden states go 0 -> 1 and back, so each device sends twice
    assert _handover_bytes(model, 10.0) == 20.0
    assert _handover_bytes(parallelize(build_gpt2("tiny", vocab_size=300), {0: [0, 1, 2, 3]}), 10.0) == 0.0


def test_markdown_table_has_a_row_per_strategy_and_names_the_machine():
    rows = [Measured("1 device", 1, 100.0, 4e6, 4e6, 0.0, None, "train()"),
            Measured("PP", 2, 150.0, 3e6, 2e6, 1e5, 0.25, "Pipe")]
    text = markdown_table(rows, machine="test machine")
    assert text.startswith("Measured on test machine.")
    assert "| PP | 2 | 3.00 MB (2.00 MB) | 150 (1.50×) | 0.10 MB | 25% |" in text


def test_widget_recomputes_when_a_control_changes():
    widget = strategy_widget("llama-2-7b", 4096, 64, 80, 8)
    report = widget.children[-2]
    assert "Pick: DP×PP, 2 x 4" in report.value
    n_gpus = widget.children[1].children[1]
    n_gpus.value = 1
    assert "No strategy fits" in report.value


def test_figures_are_drawn_from_the_planner():
    drawn = collect(["ch05"])
    assert set(drawn) == {"strategy_options_llama2_7b", "strategy_decision_map"}
    assert all(fig.axes for fig in drawn.values())
    for fig in drawn.values():
        matplotlib.pyplot.close(fig)
