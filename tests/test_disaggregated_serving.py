"""Prefill/decode disaggregation: a prefill rank and a decode rank on gloo give every request the tokens one engine
gives it (greedy: Hugging Face's), the blocks arrive with their values at the decode rank's own block ids, every
message is one batch_isend_irecv without tags, and a failing rank reaches the caller by name. One launch checks the
run; a second one the failure."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from _serving_requests import NEW, PROMPTS, hf_greedy
from parallel_lib.inference import Engine, Request, Result, ServeConfig
from parallel_lib.runtime import RankError, launch
from parallel_lib.runtime.guard import unwrap
from parallel_lib.serving import BlockManager, PagedKVCache, Scheduler, Sequence, ServingEngine, blocks_for
from parallel_lib.serving.disaggregated import (compare, disaggregated_job, gather_run, run_disaggregated,
                                                serve_rank)
from parallel_lib.serving.goodput import goodput
from parallel_lib.serving.kv_transfer import HEADER_FIELDS, gather_blocks, scatter_blocks
from parallel_lib.serving.trace import Arrival, replay_continuous

CONFIG = ServeConfig(initializer_range=0.3)
BLOCK = 4
# the shared requests (prompts of 1 to 13 tokens: 13 spans four blocks of 4, the last holding one token), then one
# done at its first token, one sampled (its random stream crosses ranks), one refused at the prefill
EXTRA = [Request([6, 5, 4], 1), Request([3, 1, 4, 1, 5], 6, temperature=1.0, seed=7), Request([1, 500], 3)]
REQUESTS = [Request(p, n) for p, n in zip(PROMPTS, NEW)] + EXTRA
TRACE = [Arrival(0.004 * i, r) for i, r in enumerate(REQUESTS)]


@pytest.fixture(scope="module")
def model():
    return CONFIG.build()


def _job(model, **kw):
    return disaggregated_job(model, TRACE, num_blocks=24, block_size=BLOCK, max_batch=3, keep_kv=True, **kw)


def recorded_rank(rank, world_size, job):
    """The library's rank, with every batch_isend_irecv recorded as [(op, peer, numel, tag, device)]."""
    batches = []
    original = dist.batch_isend_irecv

    def recording(ops):
        batches.append([("send" if unwrap(op.op) is unwrap(dist.isend) else "recv", op.peer, op.tensor.numel(),
                         op.tag, op.tensor.device.type) for op in ops])
        return original(ops)

    dist.batch_isend_irecv = recording
    try:
        return serve_rank(rank, world_size, job), batches
    finally:
        dist.batch_isend_irecv = original


def decode_fails_midway(rank, world_size, job):
    """The library's rank; the decode rank raises when it takes its second request (its blocks have arrived)."""
    if rank == 1:
        adopt, calls = ServingEngine.adopt, []

        def failing(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("injected failure while adopting a request")
            return adopt(self, *args, **kwargs)

        ServingEngine.adopt = failing
    return serve_rank(rank, world_size, job)


def prefill_stalls_midway(rank, world_size, job):
    """The library's rank; the prefill rank stops answering after sending its first request (it hangs)."""
    if rank == 0:
        import parallel_lib.serving.disaggregated as disaggregated

        send, calls = disaggregated.send_request, []

        def stalling(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                time.sleep(60)
            return send(*args, **kwargs)

        disaggregated.send_request = stalling
    return serve_rank(rank, world_size, job)


@pytest.fixture(scope="module")
def launched(model):
    job = _job(model)
    out = launch(recorded_rank, 2, job, backend="gloo", timeout=120, threads_per_rank=1)
    return job, gather_run(job, [record for record, _ in out]), [batches for _, batches in out]


# --- one launch: tokens, blocks, messages ---------------------------------------------------------------------------

def test_disaggregated_tokens_equal_hugging_face_greedy_and_one_engines_sampled_tokens(model, launched):
    _, run, _ = launched
    expected = hf_greedy(model)
    assert len({t for tokens in expected for t in tokens}) > 5, "a model that repeats one token proves little"
    assert [r.tokens for r in run.results[:len(PROMPTS)]] == expected
    one_engine = Engine.single(model, max_batch=4, max_len=24).generate(EXTRA[:2])
    done, sampled, refused = run.results[len(PROMPTS):]
    assert done.tokens == one_engine[0].tokens and len(done.tokens) == 1
    assert sampled.tokens == one_engine[1].tokens and len(sampled.tokens) == 6
    assert "outside the vocabulary" in refused.error and refused.tokens == []
    assert all(r.served_by == "rank 0 (prefill), rank 1 (decode)" for r in run.results[:len(PROMPTS)])
    assert done.served_by == "rank 0 (prefill)"                       # its first token was its last: never sent
    for r, a in zip(run.results[:-1], TRACE):                          # one clock: arrival, then tokens in order
        assert r.arrival == pytest.approx(a.time) and r.arrival < r.token_times[0]
        assert r.token_times == sorted(r.token_times)


def test_the_blocks_a_prompt_used_arrive_with_their_values_at_the_decode_ranks_own_blocks(launched):
    job, run, _ = launched
    prefill, decode = run.ranks
    continued = [i for i, r in enumerate(REQUESTS) if r.max_new_tokens > 1 and i < len(REQUESTS) - 1]
    assert sorted(prefill.tables) == sorted(decode.tables) == continued
    for i in continued:
        n = blocks_for(len(REQUESTS[i].prompt), BLOCK)                  # only the prompt's blocks travel
        assert len(prefill.tables[i]) == len(decode.tables[i]) == n
        assert prefill.kv[i].shape == (4, 2, n, BLOCK, 4, 16)            # tiny GPT-2: 4 layers, 4 heads of 16
        assert torch.equal(prefill.kv[i], decode.kv[i]), i               # read back from the decode pool's blocks
        assert prefill.kv[i].abs().sum() > 0
    assert len(prefill.tables[5]) == 4 and len(REQUESTS[5].prompt) % BLOCK == 1  # 13 tokens: a 1-token last block
    assert any(prefill.tables[i] != decode.tables[i] for i in continued)  # remapped: other ids on the decode rank
    state = 5056  # bytes of a CPU generator's state
    kv = sum(prefill.kv[i].numel() * 4 for i in continued)
    assert prefill.bytes == decode.bytes == 8 * HEADER_FIELDS * len(REQUESTS) + kv + state * len(continued)
    assert decode.steps >= max(NEW) - 1 and prefill.steps >= 1


def test_every_message_is_one_batch_isend_irecv_without_tags_header_first(launched):
    _, run, (sent, received) = launched
    continued = sorted(run.ranks[0].tables)
    headers = [b for b in sent if len(b) == 1]
    assert headers == [[("send", 1, HEADER_FIELDS, 0, "cpu")]] * len(REQUESTS)
    payloads = [b for b in sent if len(b) == 2]
    assert len(payloads) == len(continued) and len(sent) == len(headers) + len(payloads)
    assert all(kv[:2] == state[:2] == ("send", 1) and kv[3] == state[3] == 0 and state[2] == 5056
               for kv, state in payloads)
    for k, batch in enumerate(sent):                                  # each payload right after its header
        if len(batch) == 2:
            assert len(sent[k - 1]) == 1
    # the decode rank posted the mirror image: the same sizes, received from rank 0, in the same order
    assert received == [[("recv", 0, *op[2:]) for op in batch] for batch in sent]


def test_the_comparison_sets_ttft_tpot_and_goodput_beside_a_colocated_engine(model, launched):
    job, run, _ = launched
    colocated = replay_continuous(ServingEngine(model, num_blocks=24, block_size=BLOCK, max_batch=3), TRACE)
    c = compare(colocated, run, ttft_slo=10.0, tpot_slo=10.0)
    assert c.same_tokens and c.bytes_sent == run.ranks[0].bytes
    assert c.disaggregated.tokens == c.colocated.tokens == sum(len(r.tokens) for r in colocated)
    assert c.colocated_goodput.met == c.disaggregated_goodput.met == len(REQUESTS) - 1  # all but the refused one
    gaps = sorted(r.token_times[1] - r.token_times[0] for r in run.results if len(r.tokens) > 1)
    assert c.disaggregated_handoff == gaps[len(gaps) // 2] > 0                          # 7 requests: the 4th
    with pytest.raises(ValueError, match="colocated must hold a result per request"):
        compare(colocated[:3], run, 1.0, 1.0)


# --- a failing rank --------------------------------------------------------------------------------------------------

def test_a_decode_rank_that_fails_midway_reaches_the_caller_by_name_without_a_hang(model):
    start = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 of 2 raised") as excinfo:
        launch(decode_fails_midway, 2, _job(model, timeout=20.0), backend="gloo", timeout=60, threads_per_rank=1)
    assert "injected failure while adopting a request" in excinfo.value.traceback_text
    assert time.monotonic() - start < 40  # the prefill rank, blocked sending, was stopped


def test_a_stalled_prefill_rank_times_the_decode_rank_out_naming_both_ranks(model):
    start = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 of 2 raised") as excinfo:
        launch(prefill_stalls_midway, 2, _job(model, timeout=2.0), backend="gloo", timeout=60, threads_per_rank=1)
    assert ("TimeoutError: rank 1 (decode) waiting for a request's header from rank 0: nothing within timeout=2.032 s"
            in excinfo.value.traceback_text)
    assert time.monotonic() - start < 40


# --- in one process: the pieces --------------------------------------------------------------------------------------

def test_blocks_gathered_from_one_pool_land_at_other_block_ids_in_another():
    source = PagedKVCache([0, 1], num_blocks=6, block_size=2, heads=1, head_dim=3)
    for layer in (0, 1):
        source.k[layer].copy_(torch.randn(12, 1, 3))
        source.v[layer].copy_(torch.randn(12, 1, 3))
    blocks = gather_blocks(source, [5, 2])
    assert blocks.shape == (2, 2, 2, 2, 1, 3)
    assert torch.equal(blocks[1, 0, 0], source.k[1][10:12]) and torch.equal(blocks[0, 1, 1], source.v[0][4:6])
    target = PagedKVCache([0, 1], num_blocks=4, block_size=2, heads=1, head_dim=3)
    scatter_blocks(target, [0, 3], blocks)
    for layer in (0, 1):
        assert torch.equal(target.k[layer][0:2], source.k[layer][10:12])    # block 5 -> block 0
        assert torch.equal(target.v[layer][6:8], source.v[layer][4:6])      # block 2 -> block 3
        assert target.k[layer][2:6].abs().sum() == 0                        # nothing else written
    with pytest.raises(ValueError, match=r"blocks must have shape \(2, 2, 1, 2, 1, 3\)"):
        scatter_blocks(target, [1], blocks)
    with pytest.raises(ValueError, match=r"table must hold block ids in 0..3"):
        scatter_blocks(target, [0, 4], blocks)


def test_an_engine_adopts_a_prefilled_request_and_continues_it_to_hugging_faces_tokens(model):
    expected = hf_greedy(model)
    prefill = ServingEngine(model, num_blocks=16, block_size=BLOCK, max_batch=4)
    decode = ServingEngine(model, num_blocks=16, block_size=BLOCK, max_batch=2)
    shipped = {}
    prefill.on_finish = lambda seq: shipped.setdefault(seq.id, (gather_blocks(prefill.cache, prefill.blocks.table(
        seq.id)), seq.result.tokens[0], seq.generator.get_state()))
    prefill.run([Request(p, 1) for p in PROMPTS[:3]])
    for i in range(3):
        kv, token, state = shipped[i]
        table = decode.adopt(Request(PROMPTS[i], NEW[i]), i, 0.0, token, 0.0, torch.Generator().set_state(state))
        if i < 2:
            scatter_blocks(decode.cache, table, kv)
        else:
            assert table is None and 2 not in decode.results                # max_batch=2: not now, nothing changed
    while not decode.idle():
        decode.step()
    table = decode.adopt(Request(PROMPTS[2], NEW[2]), 2, 0.0, shipped[2][1], 0.0, torch.Generator())
    scatter_blocks(decode.cache, table, shipped[2][0])
    while not decode.idle():
        decode.step()
    assert [decode.results[i].tokens for i in range(3)] == expected[:3]
    assert decode.records[0].decode == [0, 1] and decode.records[0].prefill == []   # no prompt recomputed
    with pytest.raises(ValueError, match="index=0 is already"):
        decode.adopt(Request([1], 2), 0, 0.0, 1, 0.0, torch.Generator())


def test_the_scheduler_adopts_only_with_room_and_never_ahead_of_a_waiting_sequence():
    blocks = BlockManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(blocks, max_batch=2)

    def seq(i, length):
        return Sequence(i, Request([1] * length, 4), Result(i, [2]), computed=length)

    assert not scheduler.adopt(seq(0, 17)) and blocks.num_free() == 4      # 5 blocks: the pool has 4
    assert scheduler.adopt(seq(1, 8)) and blocks.table(1) == [0, 1]
    waiting = Sequence(9, Request([1], 2), Result(9))
    scheduler.add(waiting)
    assert not scheduler.adopt(seq(2, 1))                                   # request 9 came first
    scheduler.waiting.clear()
    assert scheduler.adopt(seq(2, 1)) and not scheduler.adopt(seq(3, 1))    # a block is free, but max_batch=2
    plan = scheduler.schedule()
    assert plan.starts == [8, 1] and plan.stops == [9, 2]                   # each feeds its first token


# --- goodput and bad arguments ---------------------------------------------------------------------------------------

def test_goodput_counts_requests_meeting_both_targets_per_second():
    rs = [Result(0, [1, 2, 3], arrival=0.0, token_times=[0.5, 0.7, 0.9]),   # TTFT 0.5, TPOT 0.2
          Result(1, [1, 2], arrival=1.0, token_times=[1.2, 2.2]),           # TTFT 0.2, TPOT 1.0: misses TPOT
          Result(2, [1], arrival=2.0, token_times=[2.1]),                   # one token: TTFT only
          Result(3, [1, 2], arrival=3.0, token_times=[4.0, 4.0]),          # TTFT 1.0: misses TTFT
          Result(4, error="refused")]
    g = goodput(rs, ttft_slo=0.5, tpot_slo=0.25)
    assert (g.met, g.requests, g.seconds) == (2, 5, 4.0)
    assert g.per_second == 0.5 and g.attainment == 0.4
    assert goodput(rs, 1.5, 1.5).met == 4
    with pytest.raises(ValueError, match="tpot_slo"):
        goodput(rs, 1.0, 0.0)
    with pytest.raises(ValueError, match="at least one request that got tokens"):
        goodput(rs[4:], 1.0, 1.0)


def test_bad_arguments_are_refused_by_name_before_any_rank_starts(model):
    with pytest.raises(TypeError, match="model must be"):
        run_disaggregated("gpt2", TRACE)
    with pytest.raises(TypeError, match="trace must be a list of Arrival"):
        run_disaggregated(model, TRACE[0])
    with pytest.raises(TypeError, match=r"trace\[1\] must be an Arrival"):
        run_disaggregated(model, [TRACE[0], REQUESTS[1]])
    with pytest.raises(ValueError, match="trace must hold at least one Arrival"):
        run_disaggregated(model, [])
    for name in ("prefill_ranks", "decode_ranks", "num_blocks", "block_size", "max_batch"):
        with pytest.raises(ValueError, match=name):
            run_disaggregated(model, TRACE, **{name: 0})
    with pytest.raises(ValueError, match="timeout"):
        run_disaggregated(model, TRACE, timeout=-1.0)
    with pytest.raises(ValueError, match=r"trace\[5\] needs 5 blocks of 4 .* num_blocks=4"):
        run_disaggregated(model, TRACE, num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="n_positions=128"):
        run_disaggregated(model, [Arrival(0.0, Request([1] * 120, 10))])
    job = _job(model)
    with pytest.raises(ValueError, match="world_size=3, but the job has 1 prefill and 1 decode ranks"):
        serve_rank(0, 3, job)
    with pytest.raises(ValueError, match=r"records must hold one RankRecord per rank \(2\)"):
        gather_run(job, [])
