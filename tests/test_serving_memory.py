"""Chapter 09's calculator and cost model: against numbers worked out by hand, published counts and a built model."""

import dataclasses
import math

import pytest

from parallel_lib.common import build_gpt2, count_parameters
from parallel_lib.common.models import gpt2_config
from parallel_lib.inference.cost_model import (GPUS, Hardware, Workload, calibrate_overhead, forward_bytes,
                                               forward_flops, matmul_parameters, predict, tp_crossover_width)
from parallel_lib.inference.serving_memory import (as_shape, kv_cache_bytes, kv_heads_per_rank,
                                                   max_concurrent_requests, serving_memory, weights_per_device)
from parallel_lib.model_parallel import GiB

LLAMA_7B = 6_738_415_616  # LlamaForCausalLM's parameters for LLaMA-2-7B (tests/test_shapes.py counts them)


# ----------------------------------------------------------------------------- the KV cache

def test_llama2_7b_kv_cache_is_half_a_mib_per_token_and_2_gib_per_4k_sequence():
    assert kv_cache_bytes("llama-2-7b", 1) == 2 * 32 * 32 * 128 * 2 == 2**19
    assert kv_cache_bytes("llama-2-7b", 4096) == 2 * GiB
    assert kv_cache_bytes("llama-2-7b", 4096, "fp32") == 4 * GiB


def test_grouped_query_attention_keeps_8_kv_heads_and_replicates_beyond_them():
    assert kv_cache_bytes("llama-2-70b", 1) == 2 * 80 * 8 * 128 * 2
    assert [kv_heads_per_rank("llama-2-70b", t) for t in (1, 2, 4, 8, 16)] == [8, 4, 2, 1, 1]
    assert kv_cache_bytes("llama-2-70b", 10, tp=4) == 2 * 80 * 2 * 128 * 2 * 10


def test_the_cache_of_a_course_model_splits_by_heads_and_by_layers():
    tiny = gpt2_config("tiny", 128)  # 4 layers, 4 heads of 16
    assert kv_cache_bytes(tiny, 1, "fp32") == 2 * 4 * 4 * 16 * 4
    assert kv_cache_bytes(tiny, 1, "fp32", tp=2) == 2 * 4 * 2 * 16 * 4 == 1024  # 2 of the 4 heads per rank
    pp = serving_memory(tiny, "pp", 2, "fp32")
    assert pp.kv_per_token == (2 * 2 * 4 * 16 * 4,) * 2 == (1024, 1024)  # 2 of the 4 layers per stage


# ----------------------------------------------------------------------------- weights per device

def test_weights_per_device_by_strategy():
    assert weights_per_device("llama-2-7b", "single") == [2.0 * LLAMA_7B]
    assert weights_per_device("llama-2-7b", "dp", 4) == [2.0 * LLAMA_7B] * 4
    for strategy in ("mp", "pp"):
        split = weights_per_device("llama-2-7b", strategy, 4)
        assert sum(split) == 2 * LLAMA_7B and max(split) < 0.27 * 2 * LLAMA_7B  # whole layers, near even
    h, f, v, L = 4096, 11008, 32000, 32  # tp = 2 by hand: q, k, v, o and the MLP halved, norms whole
    by_hand = L * (4 * h * h // 2 + 3 * h * f // 2 + 2 * h) + 2 * v * h // 2 + h
    assert weights_per_device("llama-2-7b", "tp", 2) == [2.0 * by_hand] * 2


# the tiny GPT-2 (L = 4, h = 64, vocabulary 128, 128 positions) in fp32, per rank:
# L·((12h² + 7h)/t + 6h) + V·h/t + 128·h + 2h, with 12h² + 7h = 49,600 and 6h = 384:
# t = 2: 4·(24,800 + 384) + 4,096 + 8,192 + 128 = 113,152; t = 4: 4·(12,400 + 384) + 2,048 + 8,192 + 128 = 61,504
@pytest.mark.parametrize("tp, per_rank", [(2, 113_152), (4, 61_504)])
def test_gpt2_tensor_parallel_shard_by_hand(tp, per_rank):
    config = gpt2_config("tiny", 128)
    assert weights_per_device(config, "tp", tp, "fp32") == [4.0 * per_rank] * tp


def test_gpt2_whole_model_is_the_built_models_parameters():
    config = gpt2_config("tiny", 128)
    whole = count_parameters(build_gpt2("tiny", vocab_size=128))  # 216,448: the tensors, counted
    assert weights_per_device(config, "tp", 1, "fp32") == [4.0 * whole]
    assert weights_per_device(config, "single", 1, "fp32") == [4.0 * whole]


def test_more_ranks_than_kv_heads_replicate_one_kv_head_per_rank():
    # LLaMA-2-70B at tp = 16 (8 KV heads of 128): per block q and o 2h²/16 = 8,388,608, each rank's own key and
    # value head 2·h·128 = 2,097,152, the MLP 3·h·f/16 = 44,040,192, two norms 2h = 16,384: 54,542,336; times 80
    # = 4,363,386,880, plus the embedding and the head 2·V·h/16 = 32,768,000 and the final norm 8,192
    assert weights_per_device("llama-2-70b", "tp", 16) == [2.0 * 4_396_163_072] * 16


def test_how_many_4k_requests_fit_on_80_gb_cards():
    single = math.floor((80 * GiB - 2 * LLAMA_7B) / (2 * GiB))
    assert max_concurrent_requests("llama-2-7b", 80 * GiB, 4096) == single == 33
    assert max_concurrent_requests("llama-2-7b", 80 * GiB, 4096, "dp", 2) == 2 * single
    # tp = 2: a rank holds 3,369,340,928 parameters (test_weights_per_device_by_strategy's sum by hand), in fp16
    # 6,738,681,856 bytes; 80 GiB = 85,899,345,920 bytes leave 79,160,664,064, and a 4k request's cache on a
    # rank (16 of the 32 KV heads) is 1 GiB = 1,073,741,824 bytes: 73.7, so 73 requests
    assert weights_per_device("llama-2-7b", "tp", 2) == [6_738_681_856.0] * 2
    assert max_concurrent_requests("llama-2-7b", 80 * GiB, 4096, "tp", 2) == 73
    # two cards hold more requests with TP than as two replicas: the weights are stored once
    assert max_concurrent_requests("llama-2-7b", 80 * GiB, 4096, "tp", 2) > 2 * single
    assert max_concurrent_requests("llama-2-70b", 80 * GiB, 4096) == 0  # 138 GB of weights


def test_kv_bytes_spread_dp_requests_over_replicas():
    memory = serving_memory("llama-2-7b", "dp", 2)
    assert memory.kv_bytes(3, 4096) == [4.0 * GiB, 2.0 * GiB]
    assert serving_memory("llama-2-7b", "tp", 2).kv_bytes(3, 4096) == [3.0 * GiB] * 2


@pytest.mark.parametrize("call, match", [
    (lambda: weights_per_device("llama-2-7b", "zero"), "strategy must be one of"),
    (lambda: weights_per_device("llama-2-7b", "single", 2), "runs on one device"),
    (lambda: kv_heads_per_rank("llama-2-7b", 3), "tp=3 must divide n_heads=32"),
    (lambda: kv_cache_bytes("llama-2-7b", -1), "tokens must be an int >= 0"),
    (lambda: kv_cache_bytes("gpt-5", 1), "model must be one of"),
    (lambda: max_concurrent_requests("llama-2-7b", 0, 4096), "capacity must be > 0"),
    (lambda: max_concurrent_requests("llama-2-7b", 80, 4096), r"capacity is in bytes, got 80; for GiB multiply"),
    (lambda: max_concurrent_requests("llama-2-7b", 80 * GiB, 4096, "pp", 33),
     "n_devices=33 is more than the model's 32 layers"),
    (lambda: serving_memory("llama-2-7b", "mp", 40), "n_devices=40 is more than the model's 32 layers"),
    (lambda: max_concurrent_requests(gpt2_config("tiny", 64), 80 * GiB, 4096),
     "tokens_per_request=4096 is longer than the model's context of 128 positions"),
])
def test_bad_input_names_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_unknown_model_object_is_a_type_error():
    with pytest.raises(TypeError, match="model must be a name"):
        kv_cache_bytes(3.5, 1)


# ----------------------------------------------------------------------------- the cost model

A100 = GPUS["A100 80GB (published)"]


def test_flops_and_bytes_by_hand():
    # the embedding lookup and the final norm multiply nothing; the blocks (norms included) and the head do
    assert matmul_parameters("llama-2-7b") == LLAMA_7B - 32000 * 4096 - 4096
    tiny = as_shape(gpt2_config("tiny", 128))
    assert matmul_parameters(tiny) == 4 * (12 * 64 * 64 + 13 * 64) + 128 * 64  # tied head counts
    # 6,738,415,616 - 131,072,000 - 4,096 = 6,607,339,520 multiplying parameters: 2 FLOPs each per token
    assert forward_flops("llama-2-7b", 100, 0) == 2 * 6_607_339_520 * 100 == 1_321_467_904_000
    # with 10 tokens of context: 4 · 32 layers · 4096 · 10 more FLOPs per token
    assert forward_flops("llama-2-7b", 1, 10) == 2 * 6_607_339_520 + 4 * 32 * 4096 * 10
    # fp16 weights once, and 3 requests' 10 cached tokens of 0.5 MiB each
    assert forward_bytes("llama-2-7b", 3, 10, "fp16") == 2 * 6_607_339_520 + 3 * 10 * 2**19 == 13_230_407_680


def test_prefill_is_compute_bound_and_decode_memory_bound_on_an_a100():
    ridge = A100.flops_per_second / A100.bytes_per_second  # ~150 FLOPs per byte
    prefill = forward_flops("llama-2-7b", 512, 256) / forward_bytes("llama-2-7b", 1, 0, "fp16")
    decode = forward_flops("llama-2-7b", 1, 512) / forward_bytes("llama-2-7b", 1, 512, "fp16")
    assert prefill > ridge > 100 * decode


def test_each_strategy_behaves_as_its_formula_says():
    w = Workload(512, 64, 1, "fp16")
    single = predict("llama-2-7b", "single", 1, w, A100)
    # dp: one request per replica runs at single's speed, n replicas multiply the throughput
    dp = predict("llama-2-7b", "dp", 2, Workload(512, 64, 2, "fp16"), A100)
    assert dp.tpot == single.tpot and dp.tokens_per_second == pytest.approx(2 * single.tokens_per_second)
    # mp: fits in half the memory, no faster
    mp = predict("llama-2-7b", "mp", 2, w, A100)
    assert mp.tpot >= single.tpot and mp.weights_per_device < 0.6 * single.weights_per_device
    # pp: one request is never faster; with as many requests as stages, more throughput than mp
    assert predict("llama-2-7b", "pp", 2, w, A100).tpot >= single.tpot
    pp2, mp2 = (predict("llama-2-7b", s, 2, Workload(512, 64, 2, "fp16"), A100) for s in ("pp", "mp"))
    assert pp2.tokens_per_second > predict("llama-2-7b", "pp", 2, w, A100).tokens_per_second
    assert pp2.ttft < mp2.ttft
    # tp on NVLink: lower latency per token for a 7B model
    assert predict("llama-2-7b", "tp", 2, w, A100).tpot < single.tpot
    assert single.fits and not predict("llama-2-70b", "single", 1, w, A100).fits


def test_calibrated_overhead_reproduces_the_measured_step():
    cpu = Hardware("cpu", 20e9, 10e9, 4 * GiB, 1e9, 50e-6)
    tiny, w = gpt2_config("tiny", 128), Workload(16, 8, 1, "fp32")
    calibrated = calibrate_overhead(tiny, cpu, 2e-3, w)
    assert calibrated.overhead > 0
    assert predict(tiny, "single", 1, w, calibrated).tpot == pytest.approx(2e-3)


def test_tp_crossover_width_is_where_tp_starts_to_win():
    slow_link = Hardware("cpu", 20e9, 10e9, 4 * GiB, 1e9, 50e-6)
    width = tp_crossover_width(slow_link, 2, 1, 32)  # widths 128, 256, ...: heads of 64, an even number
    assert width is not None and width > 128
    for h, faster in ((width, True), (width - 128, False)):
        shape = as_shape(gpt2_config("tiny", 1024, n_embd=h, n_head=h // 64, n_layer=2, n_positions=33))
        w = Workload(32, 1, 1, "fp32")
        assert (predict(shape, "tp", 2, w, slow_link).tpot < predict(shape, "single", 1, w, slow_link).tpot) == faster
    quick_link = tp_crossover_width(dataclasses.replace(slow_link, link_latency=5e-6), 2, 1, 32)
    assert quick_link is not None and quick_link < width  # the same device on a quicker link pays sooner


def test_pareto_front_keeps_the_points_nothing_beats():
    from parallel_lib.inference.cost_model import pareto_front
    points = [(1.0, 10.0), (2.0, 5.0), (2.0, 30.0), (3.0, 20.0), (4.0, 40.0), (0.5, 1.0)]
    assert pareto_front(points) == [5, 0, 2, 4]  # (2, 5) and (3, 20) are beaten by (2, 30)
