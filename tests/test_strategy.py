"""Tests for parallel_lib.planner.strategy (the planner), parallel_lib.planner.compare's pure parts and the widget.

Each named strategy is a Layout priced by planner.layout.price: its numbers are checked against
literals worked out by hand (the ZeRO paper's 16 bytes per parameter, Korthikanti et al.'s 34·s·b·h
bytes of activations per layer, the ring's 2(N-1)/N), never against the formula that priced them;
the planner must pick sensibly and refuse bad input with a message that names it.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402
from dataclasses import replace  # noqa: E402

from parallel_lib.common import build_gpt2  # noqa: E402
from parallel_lib.exercises import solutions  # noqa: E402
from parallel_lib.figures import collect  # noqa: E402
from parallel_lib.cost.alpha_beta import ring_wire_bytes  # noqa: E402
from parallel_lib.cost.shape import SHAPES, GPTShape  # noqa: E402
from parallel_lib.cost.units import GiB  # noqa: E402
from parallel_lib.model_parallel import get_device_map, parallelize  # noqa: E402
from parallel_lib.cost.activation import activation_bytes  # noqa: E402
from parallel_lib.pipeline_parallel import bubble_fraction  # noqa: E402
from parallel_lib.pipeline_parallel.gpt2 import gpt2_stages  # noqa: E402
from parallel_lib.planner import (  # noqa: E402
    PART_ONE,
    Layout,
    Measured,
    fewest_stages,
    markdown_table,
    p2p_bytes,
    plan,
)
from parallel_lib.planner.compare import _handover_bytes  # noqa: E402
from parallel_lib.viz.strategy import strategy_widget  # noqa: E402

GPT2_PARAMS = 124_439_808  # Hugging Face's gpt2, its head tied to the embedding (tests/test_shapes.py)
LLAMA_7B_PARAMS = 6_738_415_616  # meta-llama/Llama-2-7b-hf


def test_small_model_on_many_gpus_is_plain_data_parallelism():
    chosen = plan("gpt2 (124M)", seq_len=1024, batch_size=32, gpu_gib=16, n_gpus=8)
    dp = chosen.option("DP")
    assert (dp.replicas, dp.stages, dp.bubble, dp.p2p_bytes) == (8, 1, 0.0, 0.0)
    # the ZeRO paper's 16 bytes per parameter (fp16 weight and gradient, fp32 master and two moments): 16 Psi
    assert dp.state_bytes == 16 * GPT2_PARAMS == 1_991_036_928
    # Korthikanti et al. 2022, sec. 4.1: 34·s·b·h bytes per layer without stored scores; 32 / 8 = 4 sequences
    assert dp.activation_bytes == 34 * 1024 * 4 * 768 * 12 == 1_283_457_024
    # ring all-reduce of the fp16 gradients over 8 replicas: 2 (N-1)/N x 2 Psi
    assert dp.allreduce_bytes == 2 * 7 / 8 * 2 * GPT2_PARAMS == 435_539_328
    assert chosen.best is dp and "Pick: DP, 8 x 1" in chosen.explain()
    assert [o.strategy for o in chosen.options] == list(PART_ONE)


def test_7b_on_8_large_gpus_needs_pipelines_and_replicates_them():
    chosen = plan("llama-2-7b", seq_len=4096, batch_size=64, gpu_gib=80, n_gpus=8)
    assert not chosen.option("DP").feasible  # 100 GiB of training state on each GPU
    # MP: 14.0 GiB of state on the busiest stage; one micro-batch of 64/m sequences x 4 blocks x 34·s·h bytes:
    # m = 2 keeps 32 x 4 x 34 x 4096² = 68 GiB (82 GiB in all), m = 4 keeps 34 GiB (48 GiB): the fewest that fit
    mp = chosen.option("MP")
    plain = plan("llama-2-7b", seq_len=4096, batch_size=64, gpu_gib=80, n_gpus=8, accumulate=False, recompute=False)
    assert mp.feasible and mp.micro_batches == 4 and not plain.option("MP").feasible
    assert mp.activation_bytes == 16 * 4 * 34 * 4096 * 4096
    pp, hybrid = chosen.option("PP"), chosen.option("DP×PP")
    assert (pp.replicas, pp.stages, pp.micro_batches) == (1, 8, 32)  # m = 4p
    # equal stages would idle (p-1)/(m+p-1) = 7/39 of the step; the simulator also sees the last stage run
    # Llama's untied 32,000-wide head, which the others wait for
    assert bubble_fraction(8, 32) < pp.bubble < 0.3
    assert (hybrid.replicas, hybrid.stages) == (2, 4) and hybrid.feasible
    assert chosen.best is hybrid  # a smaller bubble on as many GPUs: the shortest step
    assert round(chosen.option("MP").bubble, 2) == 0.88  # one micro-batch at a time: about (p-1)/p = 7/8 idle
    # 1F1B: stage 0 keeps p = 8 micro-batches of 64 / 32 = 2 sequences, for its 32 / 8 blocks, 34·s·h bytes each
    assert pp.activation_bytes == 16 * 4 * 34 * 4096 * 4096 == 36_507_222_016
    assert "NOT feasible" in chosen.explain() and "> 80 GiB per GPU" in chosen.explain()


def test_gpipe_keeps_all_micro_batches_1f1b_only_p():
    kwargs = dict(seq_len=2048, batch_size=64, gpu_gib=80, n_gpus=4, micro_batches=16)
    gpipe, one_f_one_b = (plan("llama-2-7b", schedule=s, recompute=False, **kwargs).option("PP")
                          for s in ("gpipe", "1f1b"))
    assert gpipe.activation_bytes == pytest.approx(4 * one_f_one_b.activation_bytes)  # m = 16 vs p = 4
    assert gpipe.bubble == pytest.approx(one_f_one_b.bubble, rel=1e-12)  # the same bubble, summed in another order


@pytest.mark.parametrize("model, seq_len, batch_size, gpu_gib, n_gpus", [
    ("llama-2-13b", 2048, 256, 40, 16), ("llama-2-7b", 4096, 64, 80, 8), ("llama-2-7b", 2048, 64, 16, 16),
    ("gpt2-xl (1.5B)", 1024, 64, 16, 8), ("llama-2-70b", 4096, 64, 80, 64), ("gpt2 (124M)", 1024, 32, 16, 8)])
def test_the_exercise_layout_is_the_planners_pick(model, seq_len, batch_size, gpu_gib, n_gpus):
    # chapter 05's exercise is handed plan.fits and checked against plan.layout; the DP×PP option
    # (or DP, with one stage) must be that same layout, so chapter, planner and checker agree
    chosen = plan(model, seq_len, batch_size, gpu_gib, n_gpus)
    solved = solutions.plan_parallelism(chosen.fits, n_gpus, SHAPES[model].n_layer)
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
    # 4 micro-batches of 16 sequences (an equal split: 3 would be 22 + 21 + 21): 34 x 1024 x 16 x 1600 x 48 bytes
    assert dp is chosen.option("DP") and dp.micro_batches == 4 and not dp.recompute
    assert dp.activation_bytes == 34 * 1024 * 16 * 1600 * 48 == 42_781_900_800
    assert dp.memory_bytes <= 80 * GiB < chosen.inputs.priced(Layout(micro_batches=2)).memory_bytes  # 2 would not do
    assert "gradient accumulation: 4 micro-batches" in chosen.explain()


def test_recomputation_is_the_last_resort_and_costs_a_quarter_of_the_compute():
    kwargs = dict(seq_len=2048, batch_size=64, gpu_gib=80, n_gpus=32)
    without = plan("llama-2-70b", recompute=False, **kwargs)
    chosen = plan("llama-2-70b", **kwargs)
    assert not without.option("PP").feasible and not without.option("DP×PP").feasible
    pp, hybrid = chosen.option("PP"), chosen.option("DP×PP")
    assert pp.feasible and pp.recompute and hybrid.feasible and hybrid.recompute
    # 1F1B: p = 32 one-sequence micro-batches in flight, on stage 0's ceil(80 / 32) = 3 blocks, each keeping its
    # 2·s·h input, plus one block's 34·s·h rebuilt in backward (Korthikanti et al. sec. 5): 32 x (3 x 2 + 34) s·h
    assert pp.activation_bytes == 32 * (3 * 2 + 34) * 2048 * 8192 == 21_474_836_480
    # recomputation runs each block's forward again (a forward is 1/3 of a block's step): about 4/3 the compute
    plain = chosen.inputs.priced(replace(pp.layout, recompute=False))
    assert 1.25 < pp.priced.compute / plain.compute < 4 / 3
    assert chosen.layout is None  # the exercise's layout asks for a fit without recomputation
    # a layout that fits without recomputation never gets it
    assert not plan("llama-2-7b", 4096, 64, 80, 8).option("DP×PP").recompute


def test_recomputed_activations_keep_one_input_per_layer_and_one_full_layer():
    # GPT-2 124M, 2 sequences of 1,024 tokens, no score matrices: s·b·h = 1,572,864; Korthikanti et al. 2022
    # sec. 4.1: 34·s·b·h bytes per layer in 16-bit, 12 layers = 641,728,512; recomputed (sec. 5): each layer keeps
    # its 2-byte input, 2·s·b·h, and one layer's 34·s·b·h comes back in backward: (12·2 + 34)·s·b·h = 91,226,112
    gpt2 = SHAPES["gpt2 (124M)"]
    assert activation_bytes(2, 1024, gpt2, attention_scores=False) == 641_728_512
    assert activation_bytes(2, 1024, gpt2, attention_scores=False, recompute=True) == 91_226_112


def test_a_batch_smaller_than_the_gpus_limits_data_parallelism():
    dp = plan("gpt2 (124M)", 1024, batch_size=3, gpu_gib=16, n_gpus=8).option("DP")
    assert dp.replicas == 3 and "splits evenly over 3 of 8 GPUs" in " ".join(dp.reasons)
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
    shape = GPTShape(24, 2048, 16, 32768, 2048)
    chosen = plan(shape, 2048, 16, 24, 4)
    # 24 blocks of 12h² + 13h = 50,358,272, a 32,768 x 2048 embedding (tied head), 2048 positions, ln_f's 2h
    assert chosen.n_params == 24 * 50_358_272 + 32768 * 2048 + 2048 * 2048 + 2 * 2048 == 1_279_905_792
    assert chosen.model == "1.28 B parameters"
    lines = chosen.table().splitlines()
    assert len(lines) == 2 + len(PART_ONE) and lines[2].startswith("DP ")


def test_communication_helpers():
    assert ring_wire_bytes("all_reduce", 100.0, 1) == 0.0 and ring_wire_bytes("all_reduce", 100.0, 4) == 150.0
    assert [p2p_bytes(10.0, p) for p in (1, 2, 3, 8)] == [0.0, 10.0, 20.0, 20.0]
    # interleaved, 2 ranks x 2 model stages: rank 0 holds stages 0 and 2, sends 0->1 and 2->3 forward, 2->1 back
    assert p2p_bytes(10.0, 2, virtual=2) == 30.0 and p2p_bytes(10.0, 4, virtual=2) == 40.0


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(model="gpt-5"), ValueError, "model must be one of"),
    (dict(model=7), TypeError, "model must be a name or a GPTShape, got int"),
    (dict(seq_len=0), ValueError, "seq_len must be an int >= 1, got seq_len=0"),
    (dict(batch_size=2.5), ValueError, "batch_size must be an int >= 1"),
    (dict(n_gpus=True), ValueError, "n_gpus must be an int >= 1, got n_gpus=True"),
    (dict(micro_batches=0), ValueError, "micro_batches must be an int >= 1"),
    (dict(gpu_gib=0), ValueError, "gpu_gib must be > 0, got gpu_gib=0"),
    (dict(links="H200"), ValueError, "gpu must be one of"),
    (dict(links=25e9), TypeError, "links must be a GPU name"),
    (dict(dtype="int8"), ValueError, "dtype must be one of"),
    (dict(seq_len=1023), ValueError, "seq_len must be even"),
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


def test_one_pricing_a_pipeline_stage_holds_its_blocks_and_the_embedding_not_an_even_share():
    """Where the two planners disagreed (issue #21, "one planner"): GPT-2 (124M) as 4 replicas of 2 stages.

    Chapter 05's old planner gave every stage 16Ψ/p bytes of training state (16 x 124,439,808 / 2 =
    995,518,464) and all-reduced 2Ψ/p bytes of gradients; chapter 10's pricing counts what a stage holds:
    6 blocks of 12h² + 13h = 7,087,872, and on the first stage the 50,257 x 768 token and 1,024 x 768
    position tables (the last stage holds ln_f and its own copy of the tied head, no positions: 784,896 fewer). Chapter 04's
    own split of the real GPT-2 (built on the meta device) holds what the second says, so that is the one
    chapter 05 now shows (a run's census: ``test_hybrid.test_bytes_sent_are_what_the_planner_counts``).
    """
    option = plan("gpt2 (124M)", 1024, 32, 16, 8).option("DP×PP")
    assert (option.replicas, option.stages) == (4, 2)
    first = 6 * 7_087_872 + 50_257 * 768 + 1_024 * 768
    with torch.device("meta"):
        stages = gpt2_stages(build_gpt2("gpt2"), ["meta", "meta"])
    assert [sum(p.numel() for p in stage.parameters()) for stage in stages] == [first, first - 1_024 * 768 + 2 * 768]
    assert option.state_bytes == 16 * first == 1_310_576_640 != 16 * 124_439_808 / 2
    assert option.priced.params == first == 81_911_040
    # fp16 gradients of the first stage, ring all-reduce over 4 replicas: 2 x 3/4 x 2 bytes each
    assert option.allreduce_bytes == 2 * 3 / 4 * 2 * first == 245_733_120 != 2 * 3 / 4 * 2 * 124_439_808 / 2


def test_model_parallelism_is_a_schedule_with_one_micro_batch_in_the_pipeline():
    from parallel_lib.pipeline_parallel.simulator import simulate_schedule, validate_schedule
    from parallel_lib.planner.layout import sequential
    schedule = sequential(4, 3)
    validate_schedule(schedule)
    result = simulate_schedule(schedule, (1.0, 2.0))
    # each micro-batch runs 4 forwards of 1 and 4 backwards of 2 before the next starts: 3 x 12 = 36; a rank
    # works 3 x 3 = 9 of its 36: idle 27 / 9 = p - 1 times its work, (p - 1)/p = 3/4 of the step
    assert result.step_time == 36.0 and result.bubble == 3.0
    assert result.peak_in_flight == [1.0] * 4  # chapter 03's memory: one micro-batch's activations
