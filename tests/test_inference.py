"""The generation engine (chapter 09) in one process: Hugging Face's tokens, the KV census, sampling, failures.

The model is the course's tiny GPT-2 with a wider initialisation (``initializer_range=0.3``):
with GPT-2's 0.02 a random model mostly repeats its last token, and a test could not tell a
broken cache from a working one.
"""

from __future__ import annotations

import math

import pytest
import torch

from parallel_lib.inference import (Engine, Group, KVCache, Request, ServeConfig, check_serve, generation_schedule,
                                    group_requests, kv_cache_bytes, serve, serve_many)

CONFIG = ServeConfig(initializer_range=0.3, max_batch=4)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16], [3], [40, 41, 42]]


@pytest.fixture(scope="module")
def model():
    return CONFIG.build()


def _hf_tokens(model, prompt, n):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_greedy_tokens_equal_hugging_face_generate_for_prompts_of_different_lengths(model):
    results = Engine.single(model, max_batch=4, max_len=32).generate([Request(p, max_new_tokens=7) for p in PROMPTS])

    expected = [_hf_tokens(model, p, 7) for p in PROMPTS]  # each alone: no padding in HF's run
    assert [r.tokens for r in results] == expected
    assert len({t for tokens in expected for t in tokens}) > 5, "a model that repeats one token proves little"
    assert len({tuple(t) for t in expected}) == len(PROMPTS)


def test_model_parallel_on_two_and_four_devices_gives_the_single_engines_tokens(model):
    requests = [Request(p, max_new_tokens=5) for p in PROMPTS]
    runs = serve_many(requests, ["single", "mp"], 4, CONFIG)
    two = serve(requests, "mp", 2, CONFIG)

    assert runs["mp"].tokens == two.tokens == runs["single"].tokens
    assert [r.lane for r in runs["mp"].ranks] == ["device 0", "device 1", "device 2", "device 3"]
    # the head stays tied to device 0's embedding: the devices' weights add up to the model's, counted once
    assert sum(r.weight_bytes for r in runs["mp"].ranks) == runs["single"].ranks[0].weight_bytes
    assert sum(r.kv_bytes for r in runs["mp"].ranks) == runs["single"].ranks[0].kv_bytes
    # one stage works at a time: each device's events come in the order the hidden state visits them
    events = sorted((e for r in runs["mp"].ranks for e in r.events), key=lambda e: e.start)
    assert [e.lane for e in events[:4]] == ["device 0", "device 1", "device 2", "device 3"]


def test_kv_census_equals_the_formula_and_a_tensor_parallel_rank_holds_its_share(model):
    c = model.config
    engine = Engine.single(model, max_batch=3, max_len=20)
    head_dim = c.n_embd // c.n_head
    expected = 2 * c.n_layer * c.n_head * head_dim * 20 * 3 * 4
    assert engine.kv_bytes() == kv_cache_bytes(c.n_layer, c.n_head, head_dim, 20, 3) == expected
    assert engine.caches[0].bytes_per_token() * 20 * 3 == expected
    for tp in (2, 4):  # a rank's cache holds its n_head / tp heads
        assert KVCache(range(c.n_layer), 3, c.n_head // tp, 20, head_dim).nbytes() * tp == expected


def test_seeded_sampling_gives_the_same_tokens_whatever_shares_the_batch(model):
    sampled = [Request(p, max_new_tokens=6, temperature=1.0, seed=10 + i) for i, p in enumerate(PROMPTS)]
    together = Engine.single(model, max_batch=5, max_len=32).generate(sampled)
    alone = Engine.single(model, max_batch=1, max_len=32).generate(sampled[::-1])[::-1]
    reseeded = Engine.single(model, max_batch=5, max_len=32).generate(
        [Request(r.prompt, r.max_new_tokens, temperature=1.0, seed=r.seed + 100) for r in sampled])

    assert [r.tokens for r in together] == [r.tokens for r in alone]
    assert [r.tokens for r in together] != [r.tokens for r in reseeded], "the seed must matter"
    greedy = Engine.single(model, max_batch=5, max_len=32).generate([Request(p, max_new_tokens=6) for p in PROMPTS])
    assert [r.tokens for r in together] != [r.tokens for r in greedy], "temperature 1 must sample, not take the argmax"


@pytest.mark.parametrize("temperature", [1e-6, 1e-300, 1e-320, 5e-324])
def test_a_tiny_temperature_gives_the_greedy_tokens(model, temperature):
    # 1e-320 is a subnormal: logits / 1e-320 overflowed to inf and every token became the vocabulary's last
    greedy = Engine.single(model, max_batch=5, max_len=32).generate([Request(p, max_new_tokens=6) for p in PROMPTS])
    tiny = Engine.single(model, max_batch=5, max_len=32).generate(
        [Request(p, max_new_tokens=6, temperature=temperature, seed=i) for i, p in enumerate(PROMPTS)])
    assert [r.tokens for r in tiny] == [r.tokens for r in greedy]
    assert all(r.ok for r in tiny)


def test_eos_stops_its_request_only_and_the_timeline_has_one_event_per_token(model):
    greedy = _hf_tokens(model, PROMPTS[2], 6)
    eos = greedy[2]
    k = greedy.index(eos)
    results = Engine.single(model, max_len=32).generate([Request(PROMPTS[2], 6, eos=eos), Request(PROMPTS[0], 6)])

    assert results[0].tokens == greedy[:k + 1]
    assert results[1].tokens == _hf_tokens(model, PROMPTS[0], 6)
    for r in results:
        assert [e.kind for e in r.events] == ["prefill"] + ["decode"] * (len(r.tokens) - 1)
        assert {e.lane for e in r.events} == {f"request {r.index}"}
        assert r.token_times == [e.end for e in r.events]
        assert 0 < r.ttft and math.isclose(r.tpot, (r.token_times[-1] - r.token_times[0]) / (len(r.tokens) - 1))


def test_a_request_with_a_bad_token_id_fails_alone(model):
    good = [Request(p, max_new_tokens=4) for p in PROMPTS[:3]]
    bad = Request([5, 1000, 6], max_new_tokens=4)
    results = Engine.single(model, max_batch=4, max_len=32).generate([good[0], bad, good[1], good[2]])
    expected = Engine.single(model, max_batch=4, max_len=32).generate(good)

    assert not results[1].ok and results[1].tokens == []
    assert "request 1" in results[1].error and "[1000]" in results[1].error and "vocabulary 0..96" in results[1].error
    assert [r.tokens for r in results[:1] + results[2:]] == [r.tokens for r in expected]
    assert all(r.ok for r in expected)


def test_a_row_whose_logits_cannot_be_sampled_stops_with_its_error_and_the_others_go_on():
    group = Group([Request([1], 3), Request([2], 3)], [0, 1])
    logits = torch.zeros(2, 5)
    logits[0, 2] = 1.0
    logits[1, 0] = float("nan")
    tokens = group.accept(0, logits, 0.0, 0.5)

    assert group.results[0].tokens == [2] and tokens[0] == 2
    assert group.results[1].error == "request 1 failed at step 0: the logits are not finite (NaN or inf)"
    assert not group.active(1, 1) and group.active(0, 1)


def test_a_group_larger_than_the_cache_is_refused(model):
    engine = Engine.single(model, max_batch=2, max_len=16)
    with pytest.raises(ValueError, match=r"a batch of 3 requests is larger than the KV cache's batch=2"):
        engine.run_group(Group([Request([1], 2)] * 3, [0, 1, 2]))
    with pytest.raises(ValueError, match=r"request 0 needs 20 cache slots .* max_len=16"):
        engine.generate([Request([1] * 10, 11)])


@pytest.mark.parametrize("strategy, world_size, requests, error, match", [
    ("single", 1, [], ValueError, r"requests must hold at least one Request"),
    ("single", 1, [[1, 2]], TypeError, r"requests\[0\] must be a Request, got list"),
    ("single", 1, [Request([1] * 120, 10)], ValueError,
     r"requests\[0\].*longer than the model's context n_positions=128"),
    ("tp", 3, [Request([1])], ValueError, r"n_head=4 is not divisible by the tensor-parallel size tp=3"),
    ("pp", 5, [Request([1])], ValueError, r"world_size=5 > n_layer=4"),
    ("single", 2, [Request([1])], ValueError, r"strategy='single' runs on one device"),
    ("beam", 1, [Request([1])], ValueError, r"strategy must be one of"),
    ("dp", 0, [Request([1])], ValueError, r"world_size must be an int >= 1"),
])
def test_bad_input_is_named_before_anything_runs(strategy, world_size, requests, error, match):
    with pytest.raises(error, match=match):
        check_serve(strategy, world_size, requests, CONFIG)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(prompt=[]), ValueError, r"prompt must hold at least one token"),
    (dict(prompt="1 2"), TypeError, r"prompt must be a sequence of token ids"),
    (dict(prompt=[1.5]), TypeError, r"prompt must hold int token ids"),
    (dict(prompt=[1], max_new_tokens=0), ValueError, r"max_new_tokens must be an int >= 1"),
    (dict(prompt=[1], temperature=-1.0), ValueError, r"temperature must be >= 0"),
    (dict(prompt=[1], seed=2**64), ValueError, r"seed must be an int in 0\.\.18446744073709551615, got "
                                                r"seed=18446744073709551616.*64 bits"),
    (dict(prompt=[1], seed=-1), ValueError, r"seed must be an int in 0\.\."),
])
def test_a_bad_request_is_refused_when_made(kwargs, error, match):
    with pytest.raises(error, match=match):
        Request(**kwargs)


def test_the_pipeline_schedule_visits_every_groups_steps_round_by_round():
    assert generation_schedule([3, 1, 2]) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 2), (2, 0)]
    steps = [4, 2, 3]
    schedule = generation_schedule(steps)
    assert sorted(schedule) == sorted((t, g) for g, n in enumerate(steps) for t in range(n))
    assert group_requests(5, 2, 8) == [range(0, 3), range(3, 5)]
    assert group_requests(5, 2, 2) == [range(0, 2), range(2, 4), range(4, 5)]  # the cache caps a group
    assert group_requests(0, 2, 8) == []  # every request refused: no group (a step of 0 before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_engine_serves_a_16_bit_model_with_a_16_bit_cache(model, dtype):
    # the stages run the model's own blocks in its dtype (they were rebuilt as fp32 layers before)
    half = CONFIG.build().to(dtype)
    engine = Engine.single(half, max_batch=4, max_len=20)
    results = engine.generate([Request(p, 4) for p in PROMPTS[:4]])
    assert all(r.ok and len(r.tokens) == 4 for r in results)
    c = half.config
    assert engine.kv_bytes() == kv_cache_bytes(c.n_layer, c.n_head, c.n_embd // c.n_head, 20, 4, itemsize=2)
    assert all(t.dtype == dtype for t in engine.caches[0].tensors())
