"""Speculative decoding: a small draft model guesses ``k`` tokens, the target checks them all in one forward pass.

A decode step of a large model on a small batch is bound by reading its weights, not by arithmetic:
one token or five per row cost about the same pass. Leviathan et al. 2023 ("Fast Inference from
Transformers via Speculative Decoding") and Chen et al. 2023 ("Accelerating Large Language Model
Decoding with Speculative Sampling") spend that slack. Each *round*, for every sequence::

    draft model, k passes of one token     x1 ~ q1, x2 ~ q2, ..., xk ~ qk     (cheap: few layers)
    target, one pass of k + 1 tokens        p1, p2, ..., pk, p(k+1)            (last token + the k guesses)
    for j = 1..k:  accept xj with probability min(1, pj(xj) / qj(xj))
                   else draw from norm(max(0, pj - qj)) and stop
    all k accepted: draw a bonus token from p(k+1)

so a round yields between 1 and ``k + 1`` tokens for one target pass. **The rule keeps the target's
distribution exactly**: the chance of ending with token ``x`` is ``min(p, q)(x)`` (proposed and
accepted) plus ``(1 - Σ min(p, q)) · max(0, p - q)(x) / Σ max(0, p - q)`` (rejected, redrawn), and
since ``Σ max(0, p - q) = 1 - Σ min(p, q)`` the sum is ``min(p, q)(x) + max(0, p - q)(x) = p(x)``.
Greedy (temperature 0) is the limit: accept while the guess is the target's argmax, then take the
argmax: **the tokens are the target's own, bit for bit** (the tests prove it against Hugging Face
``generate``). The fraction of guesses accepted, ``Σ min(p, q)`` on average, is what a good draft buys.

**Inside the engine.** :class:`~parallel_lib.serving.engine.ServingEngine` speculates when it is
given a draft (``ServingEngine(model, ..., draft=draft, k=4)``): in every step, each sequence that
samples (a decode, or a prompt's last chunk) gets up to ``k`` guesses from the draft, and the step's
one target pass feeds it its new tokens and the guesses, beside prefills and chunks of other
prompts; its last ``guesses + 1`` logits check them. :class:`Drafter` is that draft side: the
draft model, its passes and the acceptance of its guesses, as vLLM runs a draft model beside its
scheduler. It pays where a pass costs about the same for one token per sequence as for ``k + 1``
(small batches, weights read from memory); on a full batch the guesses' arithmetic and the draft's
passes come on top (``python -m parallel_lib.bench serving`` measures both).

**The KV caches** are two paged pools (:mod:`.paged_kv_cache`), one per model, read through the
*same* block tables: a block holds both models' keys and values of the same tokens, so admission,
preemption, prefix caching and freeing are the engine's, unchanged. A sequence that guesses takes
blocks for its ``k`` lookahead slots from the free ones (fewer guesses when fewer are free, never a
preemption) and gives back after the step the blocks past its accepted length. A rejected guess
needs no undo: its keys and values stay in slots past the sequence's accepted length, where no
query looks, and the next step writes over them before reading (each pass writes its tokens' keys
first, then gathers). What each model holds is a count of valid tokens (``computed`` for the
target, ``draft_done`` for the draft), moved back after a rejection; prefix caching names a block
only once both pools hold it.

:class:`~parallel_lib.serving.speculative_decoder.SpeculativeDecoder` serves a list of requests that
way in one call (an engine with a draft, its pool sized for them).

The draft can be any GPT-2 of the same vocabulary; :func:`draft_from_target` makes the cheapest
one that agrees often: the target's own first layers with its head ("self-speculative" decoding,
Zhang et al. 2023, "Draft & Verify"; Elhoushi et al. 2024, "LayerSkip").
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Any, Optional

import torch

from parallel_lib.common.checks import check_int
from parallel_lib.models.gpt2 import GPT2
from parallel_lib.models.hf import as_gpt2
from parallel_lib.serving.block_manager import BlockManager
from parallel_lib.serving.layout import flat_is_cheaper, paged_forward, step_layout
from parallel_lib.serving.paged_kv_cache import PagedKVCache
from parallel_lib.serving.scheduler import Scheduled, Sequence

__all__ = ["draft_from_target", "probabilities", "draw", "verify_token", "pick", "SpeculativeStats",
           "SpeculativeSequence", "Drafter"]


def draft_from_target(model: Any, layers: int) -> GPT2:
    """A draft model: a copy of the target's embeddings, first ``layers`` blocks, final norm and head.

    Args:
        model: the target (the one GPT-2 or a Hugging Face ``GPT2LMHeadModel``).
        layers: blocks to keep, from 1 to the target's ``n_layer - 1``.

    Raises:
        ValueError: ``layers`` outside that range.
    """
    target = as_gpt2(model)
    n_layer = target.config.n_layer
    check_int("layers", layers, minimum=1, maximum=n_layer - 1, hint="a draft must be smaller than its target")
    config = copy.deepcopy(target.config)
    config.n_layer = layers
    draft = GPT2(config)
    kept = {k: v for k, v in target.state_dict().items()
            if not k.startswith("transformer.h.") or int(k.split(".")[2]) < layers}
    draft.load_state_dict(kept)
    first = next(target.parameters())
    return draft.to(first.device, first.dtype).eval()


def probabilities(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``softmax(logits / temperature)`` in float64 on the CPU, shifted by the maximum as chapter 09's ``sample``.

    Raises:
        ValueError: the logits are not all finite, or ``temperature`` is not > 0.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 for probabilities, got temperature={temperature}")
    logits = logits.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(logits).all()):
        raise ValueError("the logits are not finite (NaN or inf)")
    return torch.softmax((logits - logits.max(-1, keepdim=True).values) / temperature, dim=-1)


def draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    """One token drawn from non-negative ``weights`` (not necessarily summing to 1) by the inverse CDF."""
    cdf = weights.cumsum(0)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    return int(torch.searchsorted(cdf, u.view(1), right=True).clamp_max(len(cdf) - 1))


def verify_token(p: torch.Tensor, q: torch.Tensor, token: int, generator: torch.Generator) -> tuple[int, bool]:
    """The speculative sampling rule for one guess: ``(token, True)`` if accepted, ``(redrawn, False)`` if not.

    Accept ``token`` (drawn from ``q``) with probability ``min(1, p[token] / q[token])``; else draw
    from ``norm(max(0, p - q))``. The result is distributed as ``p`` (see the module docstring).

    Args:
        p, q: (V,) the target's and the draft's probabilities at this position.
        token: the draft's guess, drawn from ``q`` (so ``q[token] > 0``).
        generator: the sequence's random stream (one uniform for the test, one more for a redraw).
    """
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    if u * float(q[token]) < float(p[token]):  # u < p/q without dividing (q[token] > 0: it was drawn)
        return token, True
    residual = (p - q).clamp_min(0)
    # p == q up to rounding leaves no residual; then the test above accepts with probability ~1 anyway
    return draw(residual if float(residual.sum()) > 0 else p, generator), False


@dataclass
class SpeculativeStats:
    """What the rounds did: guesses proposed and accepted, passes of each model, tokens produced."""

    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    target_passes: int = 0
    draft_passes: int = 0
    tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted guesses / proposed guesses (0.0 before any)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Tokens a sequence gains per target pass on average (1 without speculation, at most ``k + 1``)."""
        return self.tokens / self.rounds if self.rounds else 0.0

    def add(self, other: "SpeculativeStats") -> None:
        """Count ``other``'s rounds, guesses, passes and tokens in these."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass(eq=False)
class SpeculativeSequence(Sequence):
    """A request in an engine that speculates: the engine's :class:`~parallel_lib.serving.scheduler.Sequence`
    (``computed``: tokens valid in the target's pool) with what the draft's pool holds and this step's guesses."""

    draft_done: int = 0                                            # tokens valid in the draft's pool
    guesses: list[int] = field(default_factory=list)
    q: list[Optional[torch.Tensor]] = field(default_factory=list)  # the draft's probabilities of each guess


def pick(seq: Sequence, logits: torch.Tensor) -> tuple[int, Optional[torch.Tensor]]:
    """A token from ``logits`` (V,) for ``seq``: the argmax (greedy) or a draw from its own stream; and the
    probabilities drawn from (None when greedy).

    Raises:
        ValueError: the logits are not all finite.
    """
    t = seq.request.temperature
    if t == 0.0:
        if not bool(torch.isfinite(logits).all()):
            raise ValueError("the logits are not finite (NaN or inf)")
        return int(logits.argmax()), None
    p = probabilities(logits, t)
    return draw(p, seq.generator), p


def _greedy(logits: torch.Tensor) -> tuple[list[int], list[bool]]:
    """Each row's argmax and whether the row is finite, for a batch of logits (n, V) in two calls (row by row,
    :func:`pick` costs more than a small model's pass on a CPU)."""
    return logits.argmax(-1).tolist(), torch.isfinite(logits).all(-1).tolist()


class Drafter:
    """The draft side of speculative decoding in the serving engine; see the module docstring.

    Args:
        draft: the draft, the one GPT-2 or a Hugging Face ``GPT2LMHeadModel`` (converted once).
        blocks: the engine's block manager: the draft's pool has its blocks, read through its tables.
        vocab_size: the target's vocabulary size.
        device: the target's device.
        k: guesses per sequence and step at most (0: none, the target alone through the same code path).

    Attributes:
        stats: the :class:`SpeculativeStats` of everything served so far.

    Raises:
        ValueError: ``k`` below 0, a vocabulary that differs from the target's, or a draft on another device.
    """

    def __init__(self, draft: Any, blocks: BlockManager, vocab_size: int, device: torch.device, k: int = 4) -> None:
        self.model = as_gpt2(draft).eval()
        vd = self.model.config.vocab_size
        if vd != vocab_size:
            raise ValueError(f"the draft's vocabulary ({vd} tokens) must be the target's ({vocab_size}): its guesses "
                             f"are token ids of the target")
        self.k = check_int("k", k, minimum=0)
        param = next(self.model.parameters())
        if param.device != torch.device(device):
            raise ValueError(f"the draft is on {param.device}, the target on {device}; move the draft to the "
                             f"target's device")
        c = self.model.config
        self.blocks, self.device = blocks, param.device
        self.cache = PagedKVCache(range(c.n_layer), blocks.num_blocks, blocks.block_size, c.n_head,
                                  c.n_embd // c.n_head, param.dtype, param.device)
        self.stats = SpeculativeStats()

    def wanted(self, seq: Sequence) -> int:
        """Guesses ``seq`` makes this step: ``k``, fewer near its limit (the target's own token ends the round)."""
        return max(0, min(self.k, seq.request.max_new_tokens - len(seq.result.tokens) - 1))

    def valid(self, seq: SpeculativeSequence) -> int:
        """Leading tokens of ``seq`` whose keys and values both pools hold (what prefix caching may name)."""
        return seq.computed if self.k == 0 else min(seq.computed, seq.draft_done)

    def _reserve(self, seq: Sequence, want: int) -> int:
        """Grow ``seq``'s table for ``want`` slots past its tokens from the free blocks; the guesses that fit."""
        length = len(seq.tokens)
        while want > 0 and not self.blocks.can_append(seq.id, length + want):
            want -= 1
        self.blocks.append(seq.id, length + want)
        return want

    @torch.no_grad()
    def propose(self, plan: Scheduled) -> list[list[int]]:
        """The draft's passes of one engine step; returns each scheduled sequence's guesses (in ``seq.guesses``).

        A sequence that samples in this step (``stop`` is its length) guesses :meth:`wanted` tokens, as
        many as free blocks hold. The first pass feeds every scheduled sequence what the draft's pool
        lacks up to ``stop`` (a chunk of a prompt, the last token or two), so both pools hold the same
        tokens; each further pass feeds the guessing sequences their newest guess.
        """
        seqs, stops = plan.sequences, plan.stops
        for seq in seqs:
            seq.guesses, seq.q = [], []
            if seq.id in plan.admitted:  # admitted or readmitted: the draft holds what the target holds (cached blocks)
                seq.draft_done = seq.computed
        self.stats.target_passes += 1
        if self.k == 0:
            return [[] for _ in seqs]
        want = [self._reserve(seq, self.wanted(seq)) if stop == len(seq.tokens) else 0
                for seq, stop in zip(seqs, stops)]
        hidden = self.model.config.n_embd
        for j in range(max(1, max(want))):
            feeds = {i: (seqs[i].tokens[:stops[i]] + seqs[i].guesses)[seqs[i].draft_done:] for i in range(len(seqs))
                     if j == 0 or want[i] > j}
            rows = [i for i, f in feeds.items() if f]
            if not rows:
                break
            starts, fed = [seqs[i].draft_done for i in rows], [feeds[i] for i in rows]
            ends = [start + len(f) for start, f in zip(starts, fed)]
            layout = step_layout([self.blocks.tables[seqs[i].id] for i in rows], fed, starts, ends,
                                 self.blocks.block_size, flat_is_cheaper([len(f) for f in fed], ends, hidden),
                                 self.device)
            x = paged_forward(self.model, self.cache.at(layout.write, layout.valid, layout.read), layout)
            logits = self.model.lm_head(x[layout.rows, layout.cols]).float().cpu()          # (rows, V)
            best, finite = _greedy(logits)
            self.stats.draft_passes += 1
            for n, (i, end) in enumerate(zip(rows, ends)):
                seq = seqs[i]
                seq.draft_done = end
                if want[i] <= j:
                    continue  # fed to keep the draft's pool up with the target's: no guess wanted
                try:
                    greedy = seq.request.temperature == 0.0 and finite[n]
                    token, q = (best[n], None) if greedy else pick(seq, logits[n])
                except ValueError as error:  # its result says so; the engine ends the request
                    seq.result.error = f"request {seq.id} failed in the draft at token {len(seq.result.tokens)}: " \
                                       f"{error}"
                    want[i] = j
                    continue
                seq.guesses.append(token)
                seq.q.append(q)
        return [list(seq.guesses) for seq in seqs]

    def accept(self, seq: SpeculativeSequence, logits: torch.Tensor, now: float) -> int:
        """Check ``seq``'s guesses against the target's ``logits`` (guesses + 1, V), extend its tokens (at ``now``)
        and move ``computed`` and ``draft_done`` to what the pools now hold; returns the guesses accepted.

        A failure (non-finite logits) goes into ``seq.result.error``, after the tokens taken before it.
        """
        old, new, accepted = len(seq.tokens), [], 0
        best, finite = _greedy(logits) if seq.request.temperature == 0.0 else ([], [])
        try:
            for j, guess in enumerate(seq.guesses):
                if seq.request.temperature == 0.0:
                    token = best[j] if finite[j] else pick(seq, logits[j])[0]  # (pick raises the error)
                    ok = token == guess
                else:
                    token, ok = verify_token(probabilities(logits[j], seq.request.temperature), seq.q[j], guess,
                                             seq.generator)
                new.append(token)
                if not ok:
                    break
                accepted += 1
            else:  # every guess accepted: a bonus token
                g = len(seq.guesses)
                new.append(best[g] if seq.request.temperature == 0.0 and finite[g] else pick(seq, logits[g])[0])
        except ValueError as error:
            seq.result.error = f"request {seq.id} failed at token {len(seq.result.tokens)}: {error}"
        stats, eos = self.stats, seq.request.eos
        stats.rounds, stats.proposed, stats.accepted = stats.rounds + 1, stats.proposed + len(seq.guesses), \
            stats.accepted + accepted
        for token in new:
            seq.result.tokens.append(token)
            seq.result.token_times.append(now)
            stats.tokens += 1
            if eos is not None and token == eos:
                break
        # the target holds keys and values for the old tokens and the accepted guesses; the draft for what
        # it was fed, as far as it agrees with them; the last new token is in neither yet (an eos cut short
        # keeps the count within the tokens)
        seq.computed = min(old + accepted, len(seq.tokens))
        seq.draft_done = min(seq.draft_done, seq.computed)
        return accepted
