"""Chapter 13's speculative decoding in the serving engine: the target's tokens exactly (greedy), the target's
distribution (sampled).

Greedy: the tokens equal Hugging Face ``generate`` on the target alone, for several prompts, numbers
of guesses and drafts (the target's first layers, which agree often, and a foreign one-layer model,
which agrees almost never), and the engine's own without a draft with requests joining while others
speculate, chunked prefill, prefix caching and preemption. Sampled: the acceptance rule's output is
distributed as the target's ``p``, checked by a chi-square test whose threshold is justified in each
test; the same test rejects the typical wrong rules, so it can fail.
"""

from __future__ import annotations

import pytest
import torch

from _serving_requests import NEW, PROMPTS, hf_greedy
from parallel_lib.common.models import build_gpt2
from parallel_lib.inference import Request, ServeConfig
from parallel_lib.serving import (ServingEngine, SpeculativeDecoder, blocks_for, draft_from_target, draw, kv_waste,
                                  verify_token)
from parallel_lib.serving.kv_transfer import gather_blocks, scatter_blocks

CONFIG = ServeConfig(initializer_range=0.3)


@pytest.fixture(scope="module")
def model():
    return CONFIG.build()


@pytest.fixture(scope="module")
def expected(model):
    return hf_greedy(model)


def speculating(model, draft, k=4, max_batch=8, requests=(), **options) -> ServingEngine:
    """An engine speculating with ``draft``, its pool large enough for ``max_batch`` of ``requests`` at once."""
    most = max((r.slots for r in requests), default=24)
    options.setdefault("num_blocks", max_batch * blocks_for(most + k, 4))
    return ServingEngine(model, block_size=4, max_batch=max_batch, draft=draft, k=k, **options)


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor, pool_below: float = 5.0) -> float:
    """Pearson's chi-square test of ``counts`` against ``probs``; cells expecting fewer than ``pool_below``
    draws are pooled into one (the chi-square approximation needs about 5 per cell)."""
    counts, probs = counts.double(), probs.double()
    n = counts.sum()
    small = probs * n < pool_below
    if bool(small.any()):
        counts = torch.cat([counts[~small], counts[small].sum().view(1)])
        probs = torch.cat([probs[~small], probs[small].sum().view(1)])
    expected = probs * n
    stat = ((counts - expected) ** 2 / expected).sum()
    df = len(counts) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))  # P(chi2_df > stat)


# --- greedy: the target's tokens, bit for bit ------------------------------------------------------

@pytest.mark.parametrize("layers,k", [(1, 1), (3, 2), (3, 4), (2, 3)])
def test_greedy_speculative_decoding_gives_hugging_faces_tokens_of_the_target(model, expected, layers, k):
    engine = speculating(model, draft_from_target(model, layers), k=k, max_batch=4)
    results = engine.run([Request(p, n) for p, n in zip(PROMPTS, NEW)])
    assert [r.tokens for r in results] == expected
    s = engine.drafter.stats
    assert s.tokens == sum(NEW) and s.proposed > 0
    if layers == 3:  # the three-layer draft agrees often: rounds of several tokens, fewer target passes
        assert s.acceptance_rate > 0.2 and s.tokens_per_round > 1.3
        assert s.target_passes < max(NEW)


def test_a_foreign_draft_that_is_always_rejected_still_gives_the_targets_tokens(model, expected):
    stranger = build_gpt2("tiny", CONFIG.vocab_size, seed=5, initializer_range=0.3, n_layer=1)
    engine = speculating(model, stranger, k=3, max_batch=6)
    assert [r.tokens for r in engine.run([Request(p, n) for p, n in zip(PROMPTS, NEW)])] == expected
    assert engine.drafter.stats.acceptance_rate < 0.1 and engine.drafter.stats.tokens_per_round < 1.1


def test_k_0_is_the_target_alone_and_eos_stops_inside_a_round(model, expected):
    plain = SpeculativeDecoder(model, draft_from_target(model, 1), k=0, block_size=4)  # the one-call form
    assert [r.tokens for r in plain.run([Request(p, n) for p, n in zip(PROMPTS, NEW)])] == expected
    plain.run([Request(PROMPTS[0], NEW[0])])
    s = plain.stats                                                  # of both runs
    assert s.tokens == sum(NEW) + NEW[0] and s.proposed == 0 and s.draft_passes == 0 and s.tokens_per_round == 1.0
    # eos: the fifth request's 4th token; accepted guesses after it are dropped
    eos = expected[4][3]
    cut = expected[4][:expected[4].index(eos) + 1]
    got = speculating(model, draft_from_target(model, 3), k=4).run([Request(PROMPTS[4], NEW[4], eos=eos)])
    assert got[0].tokens == cut and len(got[0].token_times) == len(cut)


def _admit_one_per_step(engine, requests, first=2):
    """Continuous admission: ``first`` requests, then one more before every step."""
    for r in requests[:first]:
        engine.add(r)
    for r in requests[first:]:
        engine.step()
        engine.add(r)
    while not engine.idle():
        engine.step()
    return [engine.results[i].tokens for i in range(len(requests))]


def test_the_speculating_engine_keeps_the_tokens_with_requests_joining_and_prompts_in_chunks(model, expected):
    requests = [Request(p, n) for p, n in zip(PROMPTS, NEW)]
    options = dict(num_blocks=64, block_size=4, max_batch=3, max_step_tokens=6)
    plain = ServingEngine(model, **options)
    engine = ServingEngine(model, **options, draft=draft_from_target(model, 3), k=3)
    assert _admit_one_per_step(engine, requests) == _admit_one_per_step(plain, requests) == expected

    records, stats = engine.records, engine.drafter.stats
    # requests were admitted while others speculated; the 13-token prompt went in chunks beside guessing decodes
    assert any(r.admitted and set(r.proposed) - set(r.admitted) for r in records)
    assert any(5 in r.prefill and r.fed[5] < 13 and any(r.proposed.get(i) for i in r.decode) for r in records)
    # the records hold the acceptance: their sums are the drafter's counts
    assert sum(sum(r.proposed.values()) for r in records) == stats.proposed > 0
    assert sum(sum(r.accepted.values()) for r in records) == stats.accepted > 0
    rates = [r.acceptance_rate for r in records if sum(r.proposed.values())]
    assert all(0 <= x <= 1 for x in rates) and max(rates) > 0
    assert len(records) < len(plain.records)               # fewer target passes for the same tokens
    # a decode holds blocks for its accepted length only: the k lookahead slots went back after the step
    assert all(len(r.tables[i]) == blocks_for(r.lengths[i], 4) for r in records for i in r.decode)
    assert kv_waste(records, 4, 24).paged < 4 and engine.blocks.num_free() == 64


def test_the_speculating_engine_preempts_and_shares_cached_prefixes_with_both_pools_valid(model, expected):
    requests = [Request(p, n) for p, n in zip(PROMPTS, NEW)]
    small = ServingEngine(model, num_blocks=6, block_size=4, max_batch=4, prefix_caching=True, max_step_tokens=5,
                          draft=draft_from_target(model, 3), k=3)
    assert [r.tokens for r in small.run(requests)] == expected
    assert small.preemptions > 0 and small.blocks.num_free() == 6
    # a shared system prompt: the later requests take its blocks from the cache, where the draft's keys must be
    # right too: every request makes the same guesses, and has as many accepted, as in an engine without the cache
    system = list(range(40, 52))
    shared = [Request(system + [i + 1], 6) for i in range(4)]
    accepted = []
    for caching in (False, True):
        engine = speculating(model, draft_from_target(model, 2), k=3, max_batch=4, prefix_caching=caching)
        _admit_one_per_step(engine, shared, first=1)
        accepted.append([[r.accepted.get(i) for r in engine.records if i in r.accepted] for i in range(4)])
        assert engine.blocks.hit_blocks == (3 * 3 if caching else 0)   # requests 1..3 hit the 3 blocks of 12
    assert accepted[0] == accepted[1] and sum(map(sum, accepted[1])) > 0


def test_a_speculating_engine_adopts_a_prefilled_request_and_its_draft_computes_the_prompt(model, expected):
    """Disaggregation's hand-over into a speculating engine: the target's keys come from the prefill engine, the
    draft computes its own; the guesses are those of an engine that was given prompt + first token itself."""
    prefill = ServingEngine(model, num_blocks=16, block_size=4, max_batch=3)
    shipped = {}
    prefill.on_finish = lambda seq: shipped.setdefault(seq.id, (gather_blocks(prefill.cache, prefill.blocks.table(
        seq.id)), seq.result.tokens[0], seq.generator.get_state()))
    prefill.run([Request(p, 1) for p in PROMPTS[:3]])
    decode = speculating(model, draft_from_target(model, 3), k=3, max_batch=3)
    for i in range(3):
        kv, token, state = shipped[i]
        table = decode.adopt(Request(PROMPTS[i], NEW[i]), i, 0.0, token, 0.0, torch.Generator().set_state(state))
        scatter_blocks(decode.cache, table, kv)
    while not decode.idle():
        decode.step()
    assert [decode.results[i].tokens for i in range(3)] == expected[:3]
    itself = speculating(model, draft_from_target(model, 3), k=3, max_batch=3)
    itself.run([Request(PROMPTS[i] + [shipped[i][1]], NEW[i] - 1) for i in range(3)])
    accepted = [[[r.accepted[i] for r in e.records if i in r.accepted] for i in range(3)] for e in (decode, itself)]
    assert accepted[0] == accepted[1] and sum(map(sum, accepted[0])) > 0


def test_bad_arguments_are_refused_by_name(model):
    with pytest.raises(ValueError, match="k must be an int >= 0"):
        speculating(model, draft_from_target(model, 1), k=-1)
    with pytest.raises(ValueError, match="draft's vocabulary"):
        SpeculativeDecoder(model, build_gpt2("tiny", 50, n_layer=1))
    with pytest.raises(ValueError, match=r"layers must be an int in 1..3, got layers=4; a draft must be smaller"):
        draft_from_target(model, 4)
    with pytest.raises(ValueError, match="draft's vocabulary \\(50 tokens\\) must be the target's \\(97\\)"):
        speculating(model, build_gpt2("tiny", 50, n_layer=1))
    with pytest.raises(ValueError, match="the draft is on meta, the target on cpu; move the draft"):
        speculating(model, draft_from_target(model, 1).to("meta"))
    out = speculating(model, draft_from_target(model, 1)).run([Request([500], 2), Request([1], 2)])
    assert out[0].error and "vocab" in out[0].error and out[1].ok


# --- sampled: the target's distribution -------------------------------------------------------------

P = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.25, 0.25], dtype=torch.float64)
Q = torch.tensor([0.30, 0.25, 0.20, 0.10, 0.10, 0.05], dtype=torch.float64)


def _outcomes(rule, n=3000, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts, accepted = torch.zeros(len(P)), 0
    for _ in range(n):
        token, ok = rule(P, Q, draw(Q, g), g)
        counts[token] += 1
        accepted += ok
    return counts, accepted / n


def test_the_acceptance_rule_keeps_the_targets_distribution_and_the_wrong_rules_do_not():
    """3000 draws on a 6-token vocabulary, fixed seed. Every cell expects at least 150 draws, so Pearson's
    statistic follows chi-square with 5 degrees of freedom when the rule is right; the test fails below a
    p-value of 0.001, which a right rule does for one seed in a thousand. The wrong rules move the output
    distribution by sum (p' - p)^2 / p = 0.1 (keep every guess: output q) and 0.0975 (redraw from p instead
    of the residual), so their statistic is about 3000 * 0.1 = 300: a p-value of about 1e-60."""
    counts, rate = _outcomes(verify_token)
    assert chi_square_p_value(counts, P) > 1e-3
    overlap = float(torch.minimum(P, Q).sum())                   # 0.55: the expected acceptance rate
    assert abs(rate - overlap) < 4 * (overlap * (1 - overlap) / 3000) ** 0.5  # 4 standard deviations

    def keep_every_guess(p, q, token, g):
        return token, True

    def redraw_from_p(p, q, token, g):
        if float(torch.rand((), generator=g, dtype=torch.float64)) * q[token] < p[token]:
            return token, True
        return draw(p, g), False

    for wrong in (keep_every_guess, redraw_from_p):
        assert chi_square_p_value(_outcomes(wrong)[0], P) < 1e-3, wrong.__name__


def test_sampled_speculative_decoding_draws_two_tokens_from_the_targets_joint_distribution():
    """2000 seeds of one request (2 tokens at temperature 1, one guess per round) on an 8-token vocabulary:
    the 64 pairs are compared with the target's exact joint distribution p(t1) p(t2 | t1). Cells expecting
    fewer than 5 draws are pooled; the threshold is a p-value of 0.001 as above. The draft's own joint
    distribution is rejected by the same test: it could tell a decoder that returned the guesses."""
    target = ServeConfig(vocab_size=8, initializer_range=0.3).build()
    draft = draft_from_target(target, 1)
    prompt, n = [1, 2, 3], 2000

    def joint(m):
        with torch.no_grad():
            def logits(ids):  # Hugging Face's output holds them; the one GPT-2 returns them
                out = m(ids)
                return out if isinstance(out, torch.Tensor) else out.logits

            first = torch.softmax(logits(torch.tensor([prompt]))[0, -1].double(), -1)              # (8,)
            pairs = torch.tensor([prompt + [t] for t in range(8)])
            second = torch.softmax(logits(pairs)[:, -1].double(), -1)                              # (8, 8)
        return (first[:, None] * second).view(-1)

    requests = [Request(prompt, 2, temperature=1.0, seed=s) for s in range(n)]
    engine = speculating(target, draft, k=1, max_batch=n, requests=requests)
    results = engine.run(requests)
    counts = torch.zeros(64)
    for r in results:
        counts[8 * r.tokens[0] + r.tokens[1]] += 1
    assert 0.2 < engine.drafter.stats.acceptance_rate < 0.95  # both the accepted and the redrawn path ran
    assert chi_square_p_value(counts, joint(target)) > 1e-3
    assert chi_square_p_value(counts, joint(draft)) < 1e-3
