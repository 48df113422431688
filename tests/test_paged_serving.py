"""Chapter 13's serving engine: paged KV cache, continuous batching with preemption, prefix caching.

The proofs are token identity: greedy tokens equal Hugging Face ``generate`` (each request alone)
and chapter 09's engine, through the block tables, with requests joining and leaving the batch, and
with a pool so small that requests are preempted and recomputed. The model is chapter 09's tests'
tiny GPT-2 with a wide initialisation (a random model with GPT-2's 0.02 mostly repeats one token).
"""

from __future__ import annotations

import pytest
import torch

from _serving_requests import NEW, PROMPTS, hf_greedy
from parallel_lib.bench.__main__ import main as bench_dispatch
from parallel_lib.inference import Engine, Request, Result, ServeConfig
from parallel_lib.serving import (BlockManager, PagedKVCache, PrefixCache, Scheduler, Sequence, ServingEngine,
                                  block_hashes, blocks_for, kv_waste, poisson_trace, replay_continuous, replay_static,
                                  slots_of, trace_metrics)
from parallel_lib.serving.goodput import goodput

CONFIG = ServeConfig(initializer_range=0.3)
REQUESTS = [Request(p, n) for p, n in zip(PROMPTS, NEW)]


@pytest.fixture(scope="module")
def model():
    return CONFIG.build()


@pytest.fixture(scope="module")
def expected(model):
    """Hugging Face's greedy tokens, each request alone (no padding)."""
    out = hf_greedy(model)
    assert len({t for tokens in out for t in tokens}) > 5, "a model that repeats one token proves little"
    return out


# --- the block table and the pool -----------------------------------------------------------------

def test_a_token_lives_at_its_blocks_slot_and_the_table_need_not_be_in_order():
    assert slots_of([5, 2], 0, 7, 4) == [20, 21, 22, 23, 8, 9, 10]
    assert slots_of([5, 2], 3, 5, 4) == [23, 8]
    with pytest.raises(ValueError, match="2 blocks of 4 holds 8 tokens, not 9"):
        slots_of([5, 2], 0, 9, 4)


def test_the_paged_step_writes_new_tokens_at_their_slots_and_gathers_each_row_in_token_order():
    cache = PagedKVCache([0], num_blocks=4, block_size=2, heads=1, head_dim=1)
    # row 0: tokens 0..2 in blocks [3, 1]; row 1: token 0 in block [0] (and one padding query)
    k = torch.tensor([[10.0, 11.0, 12.0], [20.0, -1.0, -1.0]]).view(2, 1, 3, 1)
    write = torch.tensor([[6, 7, 2], [0, 0, 0]])
    valid = torch.tensor([[True, True, True], [True, False, False]])
    read = torch.tensor([[6, 7, 2], [0, 0, 0]])
    keys, values = cache.at(write, valid, read).update(0, k, -k)
    assert keys.view(2, 3).tolist() == [[10.0, 11.0, 12.0], [20.0, 20.0, 20.0]]
    assert values.view(2, 3).tolist() == [[-10.0, -11.0, -12.0], [-20.0, -20.0, -20.0]]
    assert cache.k[0].view(-1).tolist() == [20.0, 0.0, 12.0, 0.0, 0.0, 0.0, 10.0, 11.0]  # padding wrote nothing
    assert cache.nbytes() == 2 * 4 * 2 * 1 * 1 * 4 and cache.bytes_per_block() == 16


def test_a_sequence_takes_a_block_when_its_last_one_is_full_and_gives_all_back():
    bm = BlockManager(num_blocks=5, block_size=4)
    assert bm.allocate("a", [1] * 5) == 0 and bm.table("a") == [0, 1]
    bm.append("a", 8)
    assert bm.table("a") == [0, 1]            # 8 tokens still fit two blocks
    bm.append("a", 9)
    assert bm.table("a") == [0, 1, 2] and bm.num_free() == 2
    assert not bm.can_allocate([1] * 9) and bm.can_allocate([1] * 8)
    bm.free("a")
    assert bm.num_free() == 5 and bm.tables == {}
    assert bm.allocate("b", [1]) == 0 and bm.table("b") == [3]  # the free list is first in, first out
    with pytest.raises(ValueError, match="already has blocks"):
        bm.allocate("b", [1])
    with pytest.raises(KeyError, match="holds no blocks"):
        bm.free("zz")
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 4)
    assert blocks_for(8, 4) == 2 and blocks_for(9, 4) == 3


def _seq(i, length, new=4):
    return Sequence(i, Request([1] * length, new), Result(i))


def test_the_scheduler_admits_first_come_first_served_and_preempts_the_newest():
    blocks = BlockManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(blocks, max_batch=4)
    a, b, c = _seq(0, 8), _seq(1, 9), _seq(2, 2)
    for s in (a, b, c):
        scheduler.add(s)
    plan = scheduler.schedule()
    assert plan.admitted == [0] and [s.id for s in scheduler.waiting] == [1, 2]  # c fits but may not overtake b
    assert plan.starts == [0] and plan.stops == [8]
    a.computed = 8
    a.result.tokens.append(5)                                  # a now holds 9 tokens: a third block
    plan = scheduler.schedule()
    assert blocks.table(0) == [0, 1, 2] and plan.preempted == [] and plan.admitted == []
    scheduler.waiting.clear()
    d = _seq(3, 4)
    scheduler.add(d)
    scheduler.schedule()                                       # d takes the last block
    a.computed, d.computed = 9, 4
    d.result.tokens.append(5)                                  # d needs a block; a is older, so d is the victim
    a.result.tokens.append(5)
    plan = scheduler.schedule()
    assert plan.preempted == [3] and [s.id for s in plan.sequences] == [0] and d.computed == 0
    assert list(scheduler.waiting) == [d] and d.preemptions == 1
    with pytest.raises(ValueError, match="max_step_tokens"):
        Scheduler(blocks, max_batch=4, max_step_tokens=2)


# --- token identity ----------------------------------------------------------------------------

def test_paged_continuous_batching_gives_hugging_face_tokens_with_requests_joining_and_leaving(model, expected):
    engine = ServingEngine(model, num_blocks=64, block_size=4, max_batch=3)
    results = engine.run(REQUESTS)

    assert [r.tokens for r in results] == expected
    assert engine.preemptions == 0
    # iteration-level batching: a request is admitted in a step where others decode
    mixed = [r for r in engine.records if r.prefill and r.decode]
    assert mixed and all(set(r.prefill) <= set(r.admitted) for r in engine.records)
    assert max(len(r.tables) for r in engine.records) == 3                    # never more than max_batch
    assert engine.records[0].admitted == [0, 1, 2] and engine.records[0].finished == []
    assert engine.records[2].finished == [1] and engine.records[3].admitted == [3]  # 1 leaves, 3 takes its place
    assert engine.blocks.num_free() == 64 and engine.idle()
    chapter09 = Engine.single(model, max_batch=3, max_len=24).generate(REQUESTS)
    assert [r.tokens for r in chapter09] == expected
    assert len(engine.records) < max(NEW[:3]) + max(NEW[3:])  # fewer steps than two static groups


def test_a_pool_too_small_for_the_batch_preempts_recomputes_and_still_gives_the_same_tokens(model, expected):
    engine = ServingEngine(model, num_blocks=6, block_size=4, max_batch=4)
    results = engine.run(REQUESTS)

    assert [r.tokens for r in results] == expected
    assert engine.preemptions >= 2
    for record in engine.records:
        assert sum(len(t) for t in record.tables.values()) <= 6                 # the pool is never overdrawn
        for victim in record.preempted:
            assert victim not in record.tables                                   # it left before the pass
    victims = {v for r in engine.records for v in r.preempted}
    readmitted = {i for r in engine.records for i in r.admitted if i in victims}
    assert victims and victims == readmitted                                  # each came back and finished
    assert engine.blocks.num_free() == 6
    # keeping the last 3 records only: the same tokens, and the counts still cover every step
    bounded = ServingEngine(model, num_blocks=6, block_size=4, max_batch=4, keep_records=3)
    assert [r.tokens for r in bounded.run(REQUESTS)] == expected
    assert [r.step for r in bounded.records] == [len(engine.records) - 3 + i for i in range(3)]
    assert bounded.steps == len(engine.records) and bounded.preemptions == engine.preemptions


def test_sampled_requests_get_chapter_09s_tokens_even_when_preempted(model):
    sampled = [Request(p, n, temperature=1.0, seed=10 + i) for i, (p, n) in enumerate(zip(PROMPTS, NEW))]
    paged = ServingEngine(model, num_blocks=6, block_size=4, max_batch=4)
    tokens = [r.tokens for r in paged.run(sampled)]
    assert paged.preemptions > 0
    assert tokens == [r.tokens for r in Engine.single(model, max_batch=6, max_len=24).generate(sampled)]


def test_eos_stops_a_request_and_frees_its_blocks_at_once(model, expected):
    eos = expected[4][2]
    engine = ServingEngine(model, num_blocks=16, block_size=4, max_batch=2)
    results = engine.run([Request(PROMPTS[4], 12, eos=eos), Request(PROMPTS[0], 7)])
    stop = expected[4].index(eos) + 1
    assert results[0].tokens == expected[4][:stop] and results[1].tokens == expected[0]
    assert engine.records[stop - 1].finished == [0]
    assert 0 not in engine.records[stop].tables


def test_chunked_prefill_feeds_long_prompts_in_chunks_beside_decodes_and_keeps_the_tokens(model, expected):
    engine = ServingEngine(model, num_blocks=64, block_size=4, max_batch=3, max_step_tokens=6)
    results = engine.run(REQUESTS)

    assert [r.tokens for r in results] == expected
    assert all(sum(r.fed.values()) <= 6 for r in engine.records)
    chunks = [r.fed[5] for r in engine.records if 5 in r.fed and r.fed[5] > 1]
    assert sum(chunks) == len(PROMPTS[5]) == 13 and len(chunks) >= 3        # the 13-token prompt, in pieces
    beside = [r for r in engine.records if 5 in r.prefill and r.decode]
    assert beside                                                            # decodes went on meanwhile
    with pytest.raises(ValueError, match="max_step_tokens"):
        ServingEngine(model, num_blocks=8, max_batch=4, max_step_tokens=3)


def test_chunked_prefill_with_prefix_caching_and_preemption_keeps_the_tokens(model, expected):
    engine = ServingEngine(model, num_blocks=6, block_size=4, max_batch=4, prefix_caching=True, max_step_tokens=5)
    assert [r.tokens for r in engine.run(REQUESTS)] == expected
    assert engine.preemptions > 0 and engine.blocks.num_free() == 6


# --- memory ------------------------------------------------------------------------------------

def test_paged_waste_is_below_one_block_per_request_and_far_below_chapter_09s_reservation(model):
    engine = ServingEngine(model, num_blocks=64, block_size=4, max_batch=6)
    engine.run(REQUESTS)
    max_len = max(r.slots for r in REQUESTS)  # what chapter 09's engine must reserve for every row: 18
    waste = kv_waste(engine.records, 4, max_len)

    # one (step, request) pair per generated token, holding prompt + tokens so far
    held = [len(p) + i for p, n in zip(PROMPTS, NEW) for i in range(n)]
    assert waste.samples == sum(NEW) == 42
    assert waste.paged == pytest.approx(sum(blocks_for(n, 4) * 4 - n for n in held) / 42)
    assert waste.reserved == pytest.approx(sum(max_len - n for n in held) / 42)
    assert waste.paged < 4 and waste.reserved > 5 * waste.paged
    with pytest.raises(ValueError, match="records must hold"):
        kv_waste([], 4, 18)


# --- prefix caching ----------------------------------------------------------------------------

def test_the_hash_chain_names_a_block_by_its_tokens_and_everything_before():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7], 2)
    assert len(a) == 3                                                   # the partial tail is not named
    assert block_hashes([1, 2, 3, 4], 2) == a[:2]
    assert block_hashes([9, 9, 3, 4], 2)[1] != a[1]                      # same tokens, other prefix: other name
    assert block_hashes([3, 4], 2, parent=a[0]) == [a[1]]


def test_released_cached_blocks_are_evicted_least_recently_released_first():
    cache = PrefixCache()
    for block, h in [(0, 100), (1, 101), (2, 102)]:
        assert cache.register(block, h)
    assert not cache.register(3, 100)                                    # 100 already names block 0
    assert cache.release(2) and cache.release(0) and cache.release(1) and not cache.release(3)
    cache.revive(0)
    assert [cache.evict(), cache.evict(), cache.evict()] == [2, 1, None]
    assert cache.lookup(100) == 0 and cache.lookup(102) is None


def test_requests_sharing_a_two_block_prompt_prefix_reuse_its_blocks_and_keep_their_tokens(model):
    system = [5, 17, 29, 41, 53, 65, 77, 89]                                   # two blocks of 4
    k = 4
    requests = [Request(system + [i + 1, i + 2], 5) for i in range(k)]
    engine = ServingEngine(model, num_blocks=32, block_size=4, max_batch=k, prefix_caching=True)
    engine.add(requests[0])
    engine.step()                                                            # request 0 computes the prefix
    for r in requests[1:]:
        engine.add(r)
    while not engine.idle():
        engine.step()

    assert engine.blocks.hit_blocks == 2 * (k - 1) == 6
    assert engine.blocks.looked_up == 2 * k and engine.blocks.hit_rate == pytest.approx(0.75)
    prefix = engine.records[0].tables[0][:2]
    assert all(engine.records[1].tables[i][:2] == prefix for i in range(k))  # one copy, four readers
    reference = Engine.single(model, max_batch=k, max_len=16).generate(requests)
    assert [engine.results[i].tokens for i in range(k)] == [r.tokens for r in reference]
    # finished, the prefix stays cached: a fifth request hits it without any request holding it
    assert engine.run([Request(system + [60], 3)])[0].tokens == \
        Engine.single(model, max_len=16).generate([Request(system + [60], 3)])[0].tokens
    assert engine.blocks.hit_blocks == 8


def test_prefix_caching_under_a_small_pool_evicts_and_keeps_hugging_face_tokens(model, expected):
    engine = ServingEngine(model, num_blocks=6, block_size=4, max_batch=4, prefix_caching=True)
    assert [r.tokens for r in engine.run(REQUESTS)] == expected
    again = ServingEngine(model, num_blocks=6, block_size=4, max_batch=4, prefix_caching=True)
    again.run(REQUESTS[:3])
    assert [r.tokens for r in again.run(REQUESTS)] == expected               # some blocks hit, some evicted
    assert again.blocks.hit_blocks > 0 and again.blocks.evicted > 0 and again.blocks.num_free() == 6


# --- bad input -----------------------------------------------------------------------------------

def test_bad_arguments_and_requests_are_refused_by_name(model, expected):
    with pytest.raises(ValueError, match="num_blocks"):
        ServingEngine(model, num_blocks=0)
    with pytest.raises(ValueError, match="block_size"):
        ServingEngine(model, num_blocks=4, block_size=0)
    with pytest.raises(ValueError, match="max_batch"):
        ServingEngine(model, num_blocks=4, max_batch=0)
    with pytest.raises(ValueError, match="keep_records must be an int >= 1, got keep_records=0; None keeps every"):
        ServingEngine(model, num_blocks=4, keep_records=0)
    engine = ServingEngine(model, num_blocks=2, block_size=4)
    with pytest.raises(TypeError, match="Request"):
        engine.add([1, 2, 3])
    with pytest.raises(ValueError, match="needs 3 blocks of 4 .* num_blocks=2"):
        engine.add(Request([1] * 8, 3))
    with pytest.raises(ValueError, match="n_positions"):
        engine.add(Request([1] * 120, 10))
    engine.add(Request([1], 2), index=7)
    with pytest.raises(ValueError, match="index=7 is already"):
        engine.add(Request([1], 2), index=7)
    with pytest.raises(ValueError, match="arrival"):
        engine.add(Request([1], 2), arrival=float("nan"))
    bad = ServingEngine(model, num_blocks=8, block_size=4).run([Request([1, 500], 3), Request(PROMPTS[1], 3)])
    assert "outside the vocabulary" in bad[0].error and bad[0].tokens == []
    assert bad[1].tokens == expected[1]


def test_a_flattened_step_longer_than_the_models_context_is_fine(model):
    requests = [Request([(7 * i + j) % 97 for j in range(20)], 3) for i in range(8)]   # 160 prompt tokens > 128
    engine = ServingEngine(model, num_blocks=48, block_size=4, max_batch=8)
    results = engine.run(requests)
    assert len(engine.records[0].prefill) == 8 and sum(len(r.prompt) for r in requests) > model.config.n_positions
    assert [r.tokens for r in results] == [r.tokens for r in Engine.single(model, 8, 22).generate(requests)]


# --- the trace and the benchmark -----------------------------------------------------------------

def test_a_poisson_trace_is_seeded_starts_at_zero_and_keeps_lengths_in_their_ranges():
    trace = poisson_trace(50, 10.0, (3, 9), (1, 4), 97, seed=3)
    assert trace == poisson_trace(50, 10.0, (3, 9), (1, 4), 97, seed=3) != poisson_trace(50, 10.0, (3, 9), (1, 4),
                                                                                         97, seed=4)
    times = [a.time for a in trace]
    assert times[0] == 0.0 and times == sorted(times)
    assert 2.0 < times[-1] < 10.0                                  # 49 gaps of mean 0.1 s
    assert {len(a.request.prompt) for a in trace} <= set(range(3, 10))
    assert {a.request.max_new_tokens for a in trace} == {1, 2, 3, 4}
    with pytest.raises(ValueError, match="rate"):
        poisson_trace(5, 0.0, (3, 9), (1, 4), 97)
    with pytest.raises(ValueError, match=r"prompt_lengths must be \(low, high\) with low <= high"):
        poisson_trace(5, 1.0, (9, 3), (1, 4), 97)
    with pytest.raises(TypeError, match="output_lengths"):
        poisson_trace(5, 1.0, (3, 9), 4, 97)


def test_static_and_continuous_replays_of_one_trace_give_the_same_tokens_and_times_on_its_clock(model):
    trace = poisson_trace(6, 500.0, (2, 8), (1, 6), 97, seed=1)
    static = replay_static(Engine.single(model, max_batch=3, max_len=14), trace)
    paged = ServingEngine(model, num_blocks=12, block_size=4, max_batch=3)
    continuous = replay_continuous(paged, trace)
    assert [r.tokens for r in static] == [r.tokens for r in continuous]
    assert [len(r.tokens) for r in continuous] == [a.request.max_new_tokens for a in trace]
    for results in (static, continuous):
        assert [r.arrival for r in results] == [a.time for a in trace]
        assert all(r.token_times[0] > r.arrival for r in results)
    metrics = trace_metrics(continuous)
    assert metrics.tokens == sum(a.request.max_new_tokens for a in trace) and metrics.throughput > 0
    assert metrics.ttft_p50 <= metrics.ttft_p99


def test_goodput_counts_the_requests_that_met_both_latency_bounds_per_second():
    results = [Result(0, [1, 2, 3], arrival=0.0, token_times=[0.1, 0.2, 0.3]),    # TTFT 0.1, TPOT 0.1: meets
               Result(1, [1, 2], arrival=0.5, token_times=[0.9, 1.0]),            # TTFT 0.4: too late
               Result(2, [1, 2], arrival=1.0, token_times=[1.1, 1.5]),            # TPOT 0.4: too slow
               Result(3, [1], arrival=1.5, token_times=[1.6]),                    # one token, no TPOT: meets
               Result(4, [], error="refused", arrival=0.0)]                       # not served
    assert goodput(results, 0.2, 0.2).per_second == pytest.approx(2 / 1.6)   # over first arrival .. last token
    assert goodput(results, 1.0, 1.0).per_second == pytest.approx(4 / 1.6)
    with pytest.raises(ValueError, match="ttft_slo"):
        goodput(results, 0.0, 0.2)
    with pytest.raises(ValueError, match="at least one request that got tokens"):
        goodput(results[4:], 0.2, 0.2)


def test_the_serving_benchmark_quick_run_prints_every_engine_and_the_endpoint_under_load(capsys):
    assert bench_dispatch(["serving", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "| static (chapter 09) | 8 |" in out and "| continuous, paged (chapter 13) | 8 |" in out
    assert "| + chunked prefill (6 tokens/step) | 8 |" in out
    assert "same tokens for every request: yes" in out
    assert "| + prefix caching | 8 |" in out and "% of prompt blocks taken from the cache" in out
    assert "| speculative, k=2, draft: first 1 layer(s) |" in out and "| yes |" in out.split("Speculative")[1]
    assert "| + speculative decoding (k=2, draft: first 1 layer(s)) | 8 |" in out and "% of " in out
    # the endpoint, driven by 32 concurrent clients: every request completed, none lost, the engines' tokens
    assert "| 32 | 32 | 32 | 0 | 0 |" in out and "lost: 0; the engines' tokens: yes" in out
    assert out.count("goodput req/s |") == 3
