"""Chapter 13's speculative decoding: the target's tokens exactly (greedy), the target's distribution (sampled).

Greedy: the tokens equal Hugging Face ``generate`` on the target alone, for several prompts, numbers
of guesses and drafts (the target's first layers, which agree often, and a foreign one-layer model,
which agrees almost never). Sampled: the acceptance rule's output is distributed as the target's
``p``, checked by a chi-square test whose threshold is justified in each test; the same test
rejects the typical wrong rules, so it can fail.
"""

from __future__ import annotations

import pytest
import torch

from _serving_requests import NEW, PROMPTS, hf_greedy
from parallel_lib.common.models import build_gpt2
from parallel_lib.inference import Request, ServeConfig
from parallel_lib.serving import SpeculativeDecoder, draft_from_target, draw, verify_token

CONFIG = ServeConfig(initializer_range=0.3)


@pytest.fixture(scope="module")
def model():
    return CONFIG.build()


@pytest.fixture(scope="module")
def expected(model):
    return hf_greedy(model)


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
    decoder = SpeculativeDecoder(model, draft_from_target(model, layers), k=k, block_size=4, max_batch=4)
    results = decoder.run([Request(p, n) for p, n in zip(PROMPTS, NEW)])
    assert [r.tokens for r in results] == expected
    s = decoder.stats
    assert s.tokens == sum(NEW) and s.proposed > 0
    if layers == 3:  # the three-layer draft agrees often: rounds of several tokens, fewer target passes
        assert s.acceptance_rate > 0.2 and s.tokens_per_round > 1.3
        assert s.target_passes < max(NEW)


def test_a_foreign_draft_that_is_always_rejected_still_gives_the_targets_tokens(model, expected):
    stranger = build_gpt2("tiny", CONFIG.vocab_size, seed=5, initializer_range=0.3, n_layer=1)
    decoder = SpeculativeDecoder(model, stranger, k=3, block_size=4, max_batch=6)
    assert [r.tokens for r in decoder.run([Request(p, n) for p, n in zip(PROMPTS, NEW)])] == expected
    assert decoder.stats.acceptance_rate < 0.1 and decoder.stats.tokens_per_round < 1.1


def test_k_0_is_the_target_alone_and_eos_stops_inside_a_round(model, expected):
    plain = SpeculativeDecoder(model, draft_from_target(model, 1), k=0, block_size=4)
    assert [r.tokens for r in plain.run([Request(p, n) for p, n in zip(PROMPTS, NEW)])] == expected
    assert plain.stats.proposed == 0 and plain.stats.draft_passes == 0 and plain.stats.tokens_per_round == 1.0
    # eos: the fifth request's 4th token; accepted guesses after it are dropped
    eos = expected[4][3]
    cut = expected[4][:expected[4].index(eos) + 1]
    got = SpeculativeDecoder(model, draft_from_target(model, 3), k=4, block_size=4).run(
        [Request(PROMPTS[4], NEW[4], eos=eos)])
    assert got[0].tokens == cut and len(got[0].token_times) == len(cut)


def test_bad_arguments_are_refused_by_name(model):
    with pytest.raises(ValueError, match="k must be an int >= 0"):
        SpeculativeDecoder(model, draft_from_target(model, 1), k=-1)
    with pytest.raises(ValueError, match=r"layers must be an int in 1..3, got layers=4; a draft must be smaller"):
        draft_from_target(model, 4)
    with pytest.raises(ValueError, match="draft's vocabulary \\(50 tokens\\) must be the target's \\(97\\)"):
        SpeculativeDecoder(model, build_gpt2("tiny", 50, n_layer=1))
    out = SpeculativeDecoder(model, draft_from_target(model, 1)).run([Request([500], 2), Request([1], 2)])
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

    decoder = SpeculativeDecoder(target, draft, k=1, block_size=4, max_batch=n)
    results = decoder.run([Request(prompt, 2, temperature=1.0, seed=s) for s in range(n)])
    counts = torch.zeros(64)
    for r in results:
        counts[8 * r.tokens[0] + r.tokens[1]] += 1
    assert 0.2 < decoder.stats.acceptance_rate < 0.95  # both the accepted and the redrawn path ran
    assert chi_square_p_value(counts, joint(target)) > 1e-3
    assert chi_square_p_value(counts, joint(draft)) < 1e-3
