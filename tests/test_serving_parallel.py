"""Parallelism inside chapter 13's serving engine: tensor-parallel ranks and data-parallel replicas.

The proofs are token identity with Hugging Face's greedy ``generate`` and the same decisions as one
engine: tp = 2 gloo ranks (one launch, three engine settings: chunked prefill; a small pool that
preempts, with prefix caching; ranks made to disagree), each rank holding half of one engine's pool,
the heads one engine's pool holds at the same slots; and replicas behind a router, in one process.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import pytest
import torch

from _serving_requests import NEW, PROMPTS, hf_greedy
from parallel_lib.inference import Request, ServeConfig
from parallel_lib.models.hf import as_gpt2
from parallel_lib.serving import ServingEngine
from parallel_lib.serving.replicas import ReplicaRouter
from parallel_lib.serving.tensor_parallel_engine import (TensorParallelServingEngine, plan_digest,
                                                         serve_tensor_parallel)
from parallel_lib.tensor_parallel import tensor_parallelize

CONFIG = ServeConfig(initializer_range=0.3)
REQUESTS = [Request(p, n) for p, n in zip(PROMPTS, NEW)]
SAMPLED = Request([5, 6, 7], 6, temperature=0.8, seed=11)  # its own seeded stream: the same draws on every rank
SETTINGS = [dict(num_blocks=64, block_size=4, max_batch=3, max_step_tokens=6),     # chunks beside decodes
            dict(num_blocks=6, block_size=4, max_batch=4, prefix_caching=True),    # preempts and recomputes
            dict(num_blocks=64, block_size=4, max_batch=8)]                        # rank 1 adds one request more
TP = 2


@pytest.fixture(scope="module")
def model():
    return CONFIG.build()


@contextmanager
def one_thread():
    """Module fixtures run before conftest's one-thread fixture: on a loaded 2-core machine two threads cost 10x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def expected(model):
    with one_thread():
        return hf_greedy(model)


@pytest.fixture(scope="module")
def ranks():
    """``ranks[setting][rank]``: every setting on tp = 2 gloo ranks, in one launch."""
    return serve_tensor_parallel(REQUESTS + [SAMPLED], TP, CONFIG, SETTINGS, timeout=60.0, keep_pool=True,
                                 skew=(2, 1), backend="gloo")


@pytest.fixture(scope="module")
def single(model):
    """One engine per setting (tp = 1: the same class without a group), run on the same requests."""
    engines = [TensorParallelServingEngine(model, None, **setting) for setting in SETTINGS[:2]]
    with one_thread():
        for engine in engines:
            engine.run(REQUESTS + [SAMPLED])
    return engines


# --- tensor parallelism ---------------------------------------------------------------------------

def test_tp_ranks_give_hugging_face_tokens_with_chunked_prefill_and_with_preemption(ranks, expected):
    for n in (0, 1):
        for report in ranks[n]:
            assert report.error is None
            assert [r.tokens for r in report.results[:-1]] == expected, (n, report.rank)
        assert ranks[n][0].results[-1].tokens == ranks[n][1].results[-1].tokens  # sampled: the same on every rank
        assert {r.served_by for report in ranks[n] for r in report.results} == {"tp ranks 0..1 (cpu)"}
    assert all(report.chunked > 0 for report in ranks[0])        # long prompts were fed in chunks
    assert all(report.preemptions >= 2 for report in ranks[1])   # and the small pool preempted


def test_every_tp_rank_makes_one_engines_decisions_and_each_pass_costs_two_all_reduces_a_layer(ranks, single, model):
    n_layer = model.config.n_layer
    for n in (0, 1):
        one = single[n]
        assert [r.tokens for r in one.results.values()] == [r.tokens for r in ranks[n][0].results]
        assert ranks[n][0].digests == ranks[n][1].digests == one.digests  # the same plan, step after step
        steps = len(one.records)
        for report in ranks[n]:  # per step: the row-parallel all-reduces, and the plan check's one all-gather
            assert report.collectives == {"all_reduce": 2 * n_layer * steps, "all_gather": steps}


def test_each_tp_rank_holds_half_of_one_engines_pool_its_heads_at_the_same_slots(ranks, single, model):
    heads = model.config.n_head
    local = heads // TP
    one = single[0]
    plain = ServingEngine(model, **SETTINGS[0])
    assert plain.cache.nbytes() == one.cache.nbytes() == 2 * model.config.n_layer * 64 * 4 * model.config.n_embd * 4
    for report in ranks[0]:
        assert report.kv_bytes * TP == one.cache.nbytes()
        for layer, (k, v) in report.pool.items():
            mine = slice(report.rank * local, (report.rank + 1) * local)
            assert k.shape[1] == local
            torch.testing.assert_close(k, one.cache.k[layer][:, mine], rtol=0, atol=1e-5)
            torch.testing.assert_close(v, one.cache.v[layer][:, mine], rtol=0, atol=1e-5)
    dense = sum(p.numel() * 4 for p in model.transformer.h.parameters())
    biases = sum(b.attn.c_proj.bias.numel() + b.mlp.c_proj.bias.numel() for b in model.transformer.h) * 4
    norms = sum(p.numel() * 4 for b in model.transformer.h for p in (*b.ln_1.parameters(), *b.ln_2.parameters()))
    ends = sum(p.numel() * 4 for p in (model.transformer.wte.weight, model.transformer.wpe.weight,
                                       *model.transformer.ln_f.parameters()))
    # the blocks' weights split in two (the row layers' biases and the norms whole), the ends whole
    assert ranks[0][0].weight_bytes == (dense - biases - norms) // TP + biases + norms + ends


def test_tp_ranks_that_disagree_on_the_plan_all_stop_naming_the_ranks(ranks):
    errors = [report.error for report in ranks[2]]
    assert all(e is not None and "step 0's plan differs between the ranks (ranks [1] disagree with rank 0" in e
               for e in errors)
    assert errors[0].startswith("tensor-parallel rank 0") and errors[1].startswith("tensor-parallel rank 1")
    assert all(report.digests == [] for report in ranks[2])  # no pass ran


def test_the_plan_digest_sees_a_different_span_or_table(model):
    engine = ServingEngine(model, num_blocks=16, block_size=4)
    engine.add(REQUESTS[0])
    plan = engine.scheduler.schedule()
    tables = {s.id: engine.blocks.table(s.id) for s in plan.sequences}
    base = plan_digest(plan, tables)
    assert plan_digest(plan, tables) == base and 0 <= base < 2 ** 56
    assert plan_digest(plan, {0: [5, 6]}) != base
    plan.stops = [plan.stops[0] - 1]
    assert plan_digest(plan, tables) != base


def test_bad_tp_arguments_are_refused_by_name_before_any_rank_starts(model):
    with pytest.raises(ValueError, match="n_head=4 is not divisible by the tensor-parallel size tp=3"):
        serve_tensor_parallel(REQUESTS, tp=3, config=CONFIG)
    with pytest.raises(TypeError, match=r"settings\[0\] names \['pool'\], not arguments of the engine"):
        serve_tensor_parallel(REQUESTS, settings=[dict(num_blocks=8, pool=3)], config=CONFIG)
    with pytest.raises(TypeError, match="settings must be a list of dicts"):
        serve_tensor_parallel(REQUESTS, settings=dict(num_blocks=8), config=CONFIG)
    with pytest.raises(ValueError, match=r"settings\[0\] must give num_blocks"):
        serve_tensor_parallel(REQUESTS, settings=[dict(block_size=4)], config=CONFIG)
    with pytest.raises(ValueError, match="settings must hold at least one setting"):
        serve_tensor_parallel(REQUESTS, settings=[], config=CONFIG)
    with pytest.raises(ValueError, match="timeout"):
        serve_tensor_parallel(REQUESTS, timeout=0, config=CONFIG)
    with pytest.raises(ValueError, match="tp"):
        serve_tensor_parallel(REQUESTS, tp=0, config=CONFIG)
    with pytest.raises(ValueError, match=r"skew must be \(setting, rank\) with setting in 0..0 and rank in 0..1"):
        serve_tensor_parallel(REQUESTS, config=CONFIG, skew=(0, 2))
    with pytest.raises(ValueError, match="already tensor-parallel"):
        TensorParallelServingEngine(tensor_parallelize(as_gpt2(model), None, vocab_parallel=False), None, 8)
    with pytest.raises(TypeError, match="model must be a Hugging Face GPT2LMHeadModel"):
        TensorParallelServingEngine("gpt2", None, 8)
    with pytest.raises(ValueError, match="timeout"):
        TensorParallelServingEngine(model, None, 8, timeout=-1)


# --- data-parallel replicas -------------------------------------------------------------------------

@pytest.mark.parametrize("policy, threads", [("sequences", True), ("blocks", False)])
def test_replicas_behind_a_router_give_the_single_engines_tokens(model, expected, policy, threads):
    router = ReplicaRouter(model, 3, num_blocks=8, block_size=4, max_batch=2, policy=policy, threads=threads)
    sampled = [SAMPLED, Request([9, 1], 5, temperature=1.2, seed=3)]
    results = router.run(REQUESTS + sampled)
    assert [r.tokens for r in results[:len(REQUESTS)]] == expected
    alone = ServingEngine(model, num_blocks=64, block_size=4, max_batch=8).run(sampled)
    assert [r.tokens for r in results[len(REQUESTS):]] == [r.tokens for r in alone]  # own seeded streams
    assert sum(router.served()) == 8 and min(router.served()) >= 1
    assert all(r.served_by == f"replica {router.assignment[r.index]} (cpu)" for r in results)
    if policy == "sequences":  # all arrive at once: each goes where the fewest wait
        assert [router.assignment[i] for i in range(8)] == [0, 1, 2, 0, 1, 2, 0, 1]
    else:  # by the blocks their prompts need: the 13-token prompt (4 blocks) goes to the lightest replica
        assert [router.assignment[i] for i in range(6)] == [0, 1, 2, 1, 0, 1]


def test_the_router_sends_a_new_request_to_the_replica_whose_requests_finished(model):
    router = ReplicaRouter(model, 2, num_blocks=16, block_size=4, max_batch=4)
    router.add(Request([1, 2, 3], 12))     # -> replica 0, long
    router.add(Request([4, 5], 2))         # -> replica 1, done after two steps
    router.step()
    router.step()
    assert router.engines[1].idle() and not router.engines[0].idle()
    assert router.load(0) == (1, -15) and router.load(1) == (0, -16)
    router.add(Request([6], 3))            # replica 1: no sequence
    router.add(Request([7], 3))            # a tie (one each): replica 1 has more free blocks
    assert [router.assignment[i] for i in range(4)] == [0, 1, 1, 1]
    while not router.idle():
        router.step()
    assert all(r.ok and len(r.tokens) == n for r, n in zip(router.results.values(), [12, 2, 3, 3]))


def test_a_replica_whose_threaded_step_hangs_is_named_after_the_timeout(model):
    with ReplicaRouter(model, 2, num_blocks=8, block_size=4, threads=True, timeout=0.2) as router:
        router.add(REQUESTS[0])
        router.add(REQUESTS[1])
        router.engines[1].step = lambda: time.sleep(2.0)
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"replica 1: its step took more than timeout=0.2 s"):
            router.step()
        assert time.monotonic() - start < 1.5


def test_bad_router_arguments_are_refused_by_name(model):
    with pytest.raises(ValueError, match="policy"):
        ReplicaRouter(model, 2, num_blocks=8, policy="random")
    with pytest.raises(ValueError, match="replicas"):
        ReplicaRouter(model, 0, num_blocks=8)
    with pytest.raises(TypeError, match="devices must be a list"):
        ReplicaRouter(model, num_blocks=8, devices="cpu")
    with pytest.raises(ValueError, match="devices must name at least one device"):
        ReplicaRouter(model, num_blocks=8, devices=[])
    with pytest.raises(ValueError, match="timeout"):
        ReplicaRouter(model, num_blocks=8, timeout=0)
    router = ReplicaRouter(model, num_blocks=8, devices=["cpu", "cpu"])
    assert len(router) == 2 and router.engines[0].model is not router.engines[1].model
    with pytest.raises(ValueError, match="replica must be an index in 0..1"):
        router.load(2)
    router.add(REQUESTS[0], index=4)
    with pytest.raises(ValueError, match="index=4 is already a request of this router"):
        router.add(REQUESTS[1], index=4)
    with pytest.raises(TypeError):
        router.add("hello")
