"""Memory estimates against hand-computed numbers; the measured report against tensor sizes."""

from collections import defaultdict

import pytest
import torch
from transformers import GPT2LMHeadModel

from parallel_lib.common import build_gpt2, count_parameters, gpt2_config
from parallel_lib.cost.activation import activation_bytes
from parallel_lib.cost.shape import SHAPES, GPTShape
from parallel_lib.model_parallel import (
    format_memory_report,
    model_memory,
    memory_report,
    parallelize,
    training_memory,
)


@pytest.mark.parametrize("dtype, optimizer, per_param", [
    ("bf16", "adamw", 16),  # ZeRO: 2 weights + 2 grads + 4 master + 4 + 4 Adam moments
    ("fp16", "adam", 16),
    ("fp32", "adamw", 16),  # 4 + 4 + 8
    ("fp32", "sgd", 8),
    ("fp32", "sgd_momentum", 12),
    ("bf16", "sgd", 8),  # 2 + 2 + 4 master
    ("fp16", None, 2),  # inference: weights only
    ("fp32", None, 4),
])
def test_training_memory_bytes_per_parameter(dtype, optimizer, per_param):
    assert training_memory(1000, dtype, optimizer).total == 1000 * per_param


def test_llama2_7b_on_16gb_v100s():
    estimate = training_memory(SHAPES["llama-2-7b"].parameters(), "fp16", "adam")
    assert estimate.total == 16 * 6_738_415_616
    v100 = 16 * 2**30
    assert [estimate.per_device(n) <= v100 for n in (1, 2, 4, 8)] == [False, False, False, True]
    assert estimate.min_devices(v100) == 7
    assert training_memory(6_738_415_616, "fp16", None).min_devices(v100) == 1, "inference weights fit one card"
    with_acts = training_memory(6_738_415_616, "fp16", "adam", activations=1e9)
    assert with_acts.total == estimate.total + 1e9


def test_activation_memory_formula():
    # s=2, b=3, h=4, a=2, L=5: per layer 2*3*4*(34 + 5*2*2/4) = 24 * 39 = 936 bytes
    shape = GPTShape(n_layer=5, n_embd=4, n_head=2, vocab_size=8, n_positions=2)
    assert activation_bytes(batch=3, seq=2, shape=shape) == 5 * 936
    assert activation_bytes(3, 2, shape, attention_scores=False) == 5 * 24 * 34


def test_activations_of_gpt2_are_korthikantis_34_plus_5as_over_h():
    """Korthikanti et al. 2022, sec. 4.1: one GPT layer keeps s·b·h·(34 + 5·a·s/h) bytes in 16-bit training
    with byte dropout masks. GPT-2 124M (h = 768, a = 12, L = 12) at s = 1024, b = 1: s·b·h = 786,432 and
    5·a·s/h = 5·12·1024/768 = 80, so a layer keeps 786,432 · 114 = 89,653,248 bytes and the model 12 times that,
    1,075,838,976 bytes; without the score matrices (FlashAttention) 786,432 · 34 = 26,738,688 per layer."""
    gpt2 = SHAPES["gpt2 (124M)"]
    assert activation_bytes(1, 1024, gpt2) == 1_075_838_976
    assert activation_bytes(1, 1024, gpt2, attention_scores=False) == 12 * 26_738_688 == 320_864_256
    # tensor parallelism, t = 4 (eq. 2): s·b·h·(10 + 24/4 + 5·a·s/(4h)) = 786,432 · (10 + 6 + 20) per layer
    assert activation_bytes(1, 1024, gpt2, tp=4) == 12 * 786_432 * 36
    # and sequence parallelism (eq. 4): s·b·h·(34 + 5·a·s/h)/t, everything split 4 ways
    assert activation_bytes(1, 1024, gpt2, tp=4, sequence_parallel=True) == 1_075_838_976 / 4
    # full recomputation (sec. 5): each layer keeps its 16-bit input, 2·s·b·h = 1,572,864 bytes; one layer whole
    assert activation_bytes(1, 1024, gpt2, recompute=True) == 12 * 1_572_864 + 89_653_248 == 108_527_616
    # under SP the kept inputs are slices too: 12 · 1,572,864 / 4 + one layer's SP share 89,653,248 / 4
    assert activation_bytes(1, 1024, gpt2, tp=4, sequence_parallel=True, recompute=True) == (12 * 1_572_864
                                                                                             + 89_653_248) / 4


def test_model_memory_adds_the_activations_of_full_length_sequences():
    # LLaMA-2-7B, one 4,096-token sequence, fp16, no score matrices: 32 · 4096 · 4096 · 34 bytes = 17 GiB
    estimate = model_memory("llama-2-7b", "fp16", "adamw", batch_size=1)
    assert estimate.activations == 32 * 4096 * 4096 * 34 == 17 * 2**30
    assert estimate.total - estimate.activations == 16 * 6_738_415_616
    assert model_memory("llama-2-7b", "fp16", None, batch_size=1).activations == 0  # inference keeps none
    # every published shape, Llama 3 8B's real 8.03B parameters (SwiGLU, 8 KV heads, untied head) included
    assert model_memory("llama-3-8b", "bf16", "adamw").total == 16 * 8_030_261_248


def test_bad_estimate_inputs():
    with pytest.raises(ValueError, match="dtype must be one of"):
        training_memory(10, "int8")
    with pytest.raises(ValueError, match="optimizer must be one of"):
        training_memory(10, "fp32", "lion")
    with pytest.raises(ValueError, match="n_params must be >= 0"):
        training_memory(-1)
    with pytest.raises(ValueError, match="n_devices must be an int >= 1"):
        training_memory(10).per_device(0)
    with pytest.raises(ValueError, match="batch must be an int >= 1"):
        activation_bytes(0, 2, GPTShape(5, 4, 2, 8, 2))


def test_gpt2_shape_matches_the_library_model():
    shape = SHAPES["gpt2 (124M)"]
    config = gpt2_config("gpt2")
    with torch.device("meta"):  # shapes only, no 500 MB of weights
        model = GPT2LMHeadModel(config)
    assert count_parameters(model) == shape.parameters()
    assert (config.n_layer, config.n_embd, config.n_head, config.n_positions) == (
        shape.n_layer, shape.n_embd, shape.n_head, shape.n_positions)


def _bytes(module, skip=()):
    return sum(p.numel() * 4 for p in module.parameters() if all(p is not s for s in skip))


def test_memory_report_counts_tensors_per_device():
    model = parallelize(build_gpt2("tiny", vocab_size=256), {0: [0, 1], 1: [2, 3]})
    optimizer = torch.optim.AdamW(model.parameters())
    body = model.transformer
    first = _bytes(body.wte) + _bytes(body.wpe) + _bytes(body.h[0]) + _bytes(body.h[1])
    last = _bytes(body.h[2]) + _bytes(body.h[3]) + _bytes(body.ln_f)

    report = memory_report(model, optimizer)
    assert [(k, r.parameters, r.gradients, r.optimizer_state) for k, r in report.items()] == [
        (0, first, 0, 0), (1, last, 0, 0)], "before a step: weights only"
    assert first + last == 4 * count_parameters(model), "the tied head is counted once"

    ids = torch.randint(0, 256, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    report = memory_report(model, optimizer)
    n_tensors = {0: len([*body.wte.parameters(), *body.wpe.parameters(), *body.h[0].parameters(),
                         *body.h[1].parameters()]),
                 1: len([*body.h[2].parameters(), *body.h[3].parameters(), *body.ln_f.parameters()])}
    for key, params in ((0, first), (1, last)):
        assert report[key].gradients == params
        # AdamW: exp_avg and exp_avg_sq like the parameter, plus a 4-byte step counter per tensor
        assert report[key].optimizer_state == 2 * params + 4 * n_tensors[key]
        assert report[key].device == "cpu" and report[key].cuda_peak is None
    table = format_memory_report(report)
    assert table.splitlines()[0].split()[:3] == ["key", "device", "params"] and len(table.splitlines()) == 3


def test_memory_report_of_an_unplaced_model_has_one_key():
    model = build_gpt2("tiny", vocab_size=256)
    report = memory_report(model)
    assert list(report) == [0] and report[0].parameters == 4 * count_parameters(model)


def test_plot_memory_bars_are_the_estimate_split_evenly():
    import matplotlib
    matplotlib.use("Agg")
    from parallel_lib.viz.memory import plot_memory

    estimate = training_memory(2**30, "fp16", "adamw")  # 16 GiB in total
    fig = plot_memory(estimate, 16 * 2**30, n_devices=2, max_devices=4)
    ax = fig.axes[0]
    stacked = defaultdict(float)  # devices -> GiB per device, summed over the stacked parts
    for bar in ax.patches:
        if bar.get_fill():  # the outline around the chosen bar is unfilled
            stacked[round(bar.get_x() + bar.get_width() / 2)] += bar.get_height()
    assert dict(stacked) == pytest.approx({1: 16.0, 2: 8.0, 3: 16 / 3, 4: 4.0})
    assert "fits" in ax.get_title() and "NOT" not in ax.get_title()
