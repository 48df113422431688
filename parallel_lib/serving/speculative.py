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

**The KV caches** are two paged pools (:mod:`.paged_kv_cache`), one per model, with a block table per
sequence. A rejected guess needs no undo: its keys and values stay in slots past the sequence's
accepted length, where no query looks, and the next round writes over them before reading (each
pass writes its tokens' keys first, then gathers). What each model holds is just a count of valid
tokens, moved back after a rejection.

**The batch.** :class:`SpeculativeDecoder` serves its requests in groups of ``max_batch``, each
group to its end, every round a padded batch (:mod:`.layout`) with each row's own number of
guesses; a request's blocks (prompt + new tokens) are taken when its group starts. It is the
clean path for this chapter's proof and measurement, beside the continuous engine rather than
inside its scheduler (vLLM schedules the ``k`` extra slots per sequence in its scheduler).

The draft can be any GPT-2 of the same vocabulary; :func:`draft_from_target` makes the cheapest
one that agrees often: the target's own first layers with its head ("self-speculative" decoding,
Zhang et al. 2023, "Draft & Verify"; Elhoushi et al. 2024, "LayerSkip").
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence as Seq

import torch

from parallel_lib.common.checks import check_int, positive_int
from parallel_lib.inference.batch import Request, Result, check_requests
from parallel_lib.inference.engine import admit
from parallel_lib.models.gpt2 import GPT2
from parallel_lib.models.hf import as_gpt2
from parallel_lib.serving.block_manager import BlockManager, blocks_for
from parallel_lib.serving.layout import paged_forward, step_layout
from parallel_lib.serving.paged_kv_cache import PagedKVCache
from parallel_lib.serving.scheduler import Sequence

__all__ = ["draft_from_target", "probabilities", "draw", "verify_token", "SpeculativeStats", "SpeculativeDecoder"]


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


@dataclass(eq=False)
class _Row(Sequence):
    """A request in a group: the engine's :class:`~parallel_lib.serving.scheduler.Sequence` (``computed``:
    tokens valid in the target's pool) with what the draft holds and this round's guesses."""

    draft_done: int = 0                                            # tokens valid in the draft's pool
    guesses: list[int] = field(default_factory=list)
    q: list[Optional[torch.Tensor]] = field(default_factory=list)  # the draft's probabilities of each guess


class SpeculativeDecoder:
    """Speculative decoding of a target GPT-2 with a draft GPT-2 over two paged pools; see the module docstring.

    Args:
        target, draft: the one GPT-2 or Hugging Face ``GPT2LMHeadModel`` each (converted once), with
            the same vocabulary and device.
        k: guesses per round (0: the target alone, one token per pass: the baseline).
        block_size: token slots per block of both pools.
        max_batch: requests decoded together (a group runs to its end before the next starts).

    Attributes:
        stats: the :class:`SpeculativeStats` of everything served so far.

    Raises:
        ValueError: ``k`` below 0, a count below 1, or vocabularies that differ.
    """

    def __init__(self, target: Any, draft: Any, k: int = 4, block_size: int = 16, max_batch: int = 8) -> None:
        self.target, self.draft = as_gpt2(target).eval(), as_gpt2(draft).eval()
        vt, vd = self.target.config.vocab_size, self.draft.config.vocab_size
        if vt != vd:
            raise ValueError(f"the draft's vocabulary ({vd} tokens) must be the target's ({vt}): its guesses are "
                             f"token ids of the target")
        self.k = check_int("k", k, minimum=0)
        self.block_size, self.max_batch = positive_int("block_size", block_size), positive_int("max_batch", max_batch)
        self.vocab_size, self.n_positions = vt, self.target.config.n_positions
        self.device = next(self.target.parameters()).device
        self.stats = SpeculativeStats()

    def run(self, requests: Seq[Request]) -> list[Result]:
        """Serve ``requests`` (indices ``0..n-1``), ``max_batch`` at a time; one Result each, in order.

        Raises:
            TypeError, ValueError: as chapter 09's engine (:func:`~parallel_lib.inference.batch.check_requests`).
        """
        requests = check_requests(requests, self.n_positions)
        indices = list(range(len(requests)))
        admitted, refused = admit(requests, indices, self.vocab_size)
        results = {r.index: r for r in refused}
        t0, arrival = time.perf_counter(), 0.0
        for start in range(0, len(admitted), self.max_batch):
            rows = [_Row(i, requests[i], Result(i, arrival=arrival, served_by=str(self.device)),
                         generator=torch.Generator().manual_seed(requests[i].seed))
                    for i in admitted[start:start + self.max_batch]]
            self._serve(rows, t0)
            results.update({row.id: row.result for row in rows})
        return [results[i] for i in indices]

    # --- one group ---------------------------------------------------------------------------------
    def _pool(self, model: GPT2, rows: list[_Row]) -> tuple[BlockManager, PagedKVCache]:
        c = model.config
        blocks = BlockManager(sum(blocks_for(r.request.slots, self.block_size) for r in rows), self.block_size)
        for r in rows:
            blocks.allocate(r.id, [0] * r.request.slots)
        param = next(model.parameters())
        return blocks, PagedKVCache(range(c.n_layer), blocks.num_blocks, self.block_size, c.n_head,
                                    c.n_embd // c.n_head, param.dtype, param.device)

    @torch.no_grad()
    def _pass(self, model: GPT2, pool: tuple[BlockManager, PagedKVCache], rows: list[_Row], starts: list[int],
              tokens: list[list[int]]) -> list[torch.Tensor]:
        """One padded pass of ``model`` feeding each row ``tokens`` from ``starts``; each row's logits (fed, V)."""
        blocks, cache = pool
        stops = [s + len(t) for s, t in zip(starts, tokens)]
        layout = step_layout([blocks.tables[r.id] for r in rows], tokens, starts, stops, self.block_size,
                             flat=False, device=self.device)
        x = paged_forward(model, cache.at(layout.write, layout.valid, layout.read), layout)
        logits = model.lm_head(x).float().cpu()                                              # (b, S, V)
        return [logits[i, :len(t)] for i, t in enumerate(tokens)]

    def _pick(self, row: _Row, logits: torch.Tensor) -> tuple[int, Optional[torch.Tensor]]:
        """A token from ``logits`` (V,) for ``row``: the argmax (greedy) or a draw; and the probabilities drawn from."""
        t = row.request.temperature
        if t == 0.0:
            if not bool(torch.isfinite(logits).all()):
                raise ValueError("the logits are not finite (NaN or inf)")
            return int(logits.argmax()), None
        p = probabilities(logits, t)
        return draw(p, row.generator), p

    def _serve(self, rows: list[_Row], t0: float) -> None:
        target, draft = self._pool(self.target, rows), self._pool(self.draft, rows)
        active = list(rows)
        while active:
            # how many guesses each row makes: k, fewer near its limit (the target's token ends the round)
            want = {r.id: min(self.k, r.request.max_new_tokens - len(r.result.tokens) - 1) for r in active}
            for r in active:
                r.guesses, r.q = [], []
            for j in range(self.k):
                guessing = [r for r in active if want[r.id] > j]
                if not guessing:
                    break
                fed = [(r.tokens + r.guesses)[r.draft_done:] for r in guessing]
                out = self._pass(self.draft, draft, guessing, [r.draft_done for r in guessing], fed)
                self.stats.draft_passes += 1
                for r, f, logits in zip(guessing, fed, out):
                    r.draft_done += len(f)
                    try:
                        token, q = self._pick(r, logits[-1])
                    except ValueError as error:  # its result says so; the row leaves the group
                        r.result.error = f"request {r.id} failed in the draft at token {len(r.result.tokens)}: " \
                                         f"{error}"
                        want[r.id] = j
                        continue
                    r.guesses.append(token)
                    r.q.append(q)
            active = [r for r in active if r.result.error is None]
            if not active:
                break
            fed = [(r.tokens + r.guesses)[r.computed:] for r in active]
            out = self._pass(self.target, target, active, [r.computed for r in active], fed)
            self.stats.target_passes += 1
            now = time.perf_counter() - t0
            for r, logits in zip(active, out):
                self._accept(r, logits[-(len(r.guesses) + 1):], now)
            active = [r for r in active if not r.finished()]

    def _accept(self, row: _Row, logits: torch.Tensor, now: float) -> None:
        """Check ``row``'s guesses against the target's ``logits`` (guesses + 1, V) and extend its tokens."""
        old, new, accepted = len(row.tokens), [], 0
        try:
            for j, guess in enumerate(row.guesses):
                if row.request.temperature == 0.0:
                    token, _ = self._pick(row, logits[j])
                    ok = token == guess
                else:
                    token, ok = verify_token(probabilities(logits[j], row.request.temperature), row.q[j], guess,
                                             row.generator)
                new.append(token)
                if not ok:
                    break
                accepted += 1
            else:
                new.append(self._pick(row, logits[len(row.guesses)])[0])  # every guess accepted: a bonus token
        except ValueError as error:
            row.result.error = f"request {row.id} failed at token {len(row.result.tokens)}: {error}"
        stats, eos = self.stats, row.request.eos
        stats.rounds, stats.proposed, stats.accepted = stats.rounds + 1, stats.proposed + len(row.guesses), \
            stats.accepted + accepted
        for token in new:
            row.result.tokens.append(token)
            row.result.token_times.append(now)
            stats.tokens += 1
            if eos is not None and token == eos:
                break
        # the target holds keys and values for the old tokens and the accepted guesses; the draft for what
        # it was fed, as far as it agrees with them; the last new token is in neither yet
        row.computed = old + accepted
        row.draft_done = min(row.draft_done, old + accepted)
