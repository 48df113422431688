"""Requests, results, and one group of requests served together: where each token goes, what it sees.

A :class:`Group` is a batch of requests with prompts of different lengths. Its plan is a pure
function of the requests, the same on every rank, so pipeline stages and tensor-parallel
ranks agree on every shape without talking about it:

- **prefill** (step 0): the prompts, right-padded to the longest; row ``b``'s token ``i``
  goes to slot ``i`` at position ``i``; a query sees the keys at or before it (causal) and
  inside its own prompt. Padding queries compute garbage that nobody reads, and their
  keys sit in slots the row's decode steps overwrite before any query may see them.
- **decode step t** (t >= 1): the token sampled at step ``t-1`` goes to slot
  ``p_b = L_b + t - 1`` (its position) and sees slots ``0..p_b``.

A row whose request has all its tokens (or stopped at end-of-sequence) keeps computing
until the group's longest request is done; its outputs are dropped and its slot stops
advancing at its own last one (``L_b + max_new_tokens_b - 2``), so it never reaches past
the cache or the model's positions. That waste is what continuous batching (Orca, vLLM)
removes by letting requests leave and join a running batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Integral
from typing import Any, Optional, Sequence

import torch

from parallel_lib.common.checks import check_int, check_number, positive_int
from parallel_lib.common.timeline import Event

__all__ = ["Request", "Result", "StepInput", "Group", "check_requests", "sample"]


@dataclass(frozen=True)
class Request:
    """One generation request.

    Attributes:
        prompt: the prompt's token ids (at least one).
        max_new_tokens: tokens to generate at most.
        eos: stop after generating this token (it is kept in the output); None: only the limit stops.
        temperature: 0 for greedy decoding, else sample from ``softmax(logits / temperature)``
            (however small: :func:`sample` cannot overflow, and a tiny one gives the greedy tokens).
        seed: the seed of this request's own random stream, in ``[0, 2**64)`` (a
            ``torch.Generator``'s): the same seed gives the same tokens whichever other requests
            share its batch, rank or stage.
    """

    prompt: tuple[int, ...]
    max_new_tokens: int = 8
    eos: Optional[int] = None
    temperature: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        prompt = self.prompt.tolist() if isinstance(self.prompt, torch.Tensor) else self.prompt
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
            raise TypeError(f"prompt must be a sequence of token ids, got {type(self.prompt).__name__}")
        if not all(isinstance(t, Integral) and not isinstance(t, bool) for t in prompt):
            raise TypeError(f"prompt must hold int token ids, got {list(prompt)[:8]!r}")
        if len(prompt) == 0:
            raise ValueError("prompt must hold at least one token, got an empty prompt; a request with no "
                             "tokens has nothing to condition on")
        object.__setattr__(self, "prompt", tuple(int(t) for t in prompt))
        positive_int("max_new_tokens", self.max_new_tokens)
        if self.eos is not None:
            check_int("eos", self.eos, minimum=0)
        check_number("temperature", self.temperature, 0.0, hint="use 0 for greedy decoding")
        check_int("seed", self.seed, minimum=0, maximum=2**64 - 1, hint="a torch.Generator's seed is 64 bits")

    @property
    def slots(self) -> int:
        """Cache slots this request needs: its prompt and every generated token but the last."""
        return len(self.prompt) + self.max_new_tokens - 1


def check_requests(requests: Any, n_positions: int) -> list[Request]:
    """``requests`` as a list, after the checks that must fail before anything runs.

    Raises:
        ValueError: no requests, or a request whose prompt plus new tokens exceeds the model's context.
        TypeError: an item that is not a :class:`Request`.
    """
    if isinstance(requests, Request) or not isinstance(requests, Sequence):
        raise TypeError(f"requests must be a list of Request, got {type(requests).__name__}")
    if len(requests) == 0:
        raise ValueError("requests must hold at least one Request, got an empty list")
    for i, r in enumerate(requests):
        if not isinstance(r, Request):
            raise TypeError(f"requests[{i}] must be a Request, got {type(r).__name__}")
        if r.slots > n_positions:
            raise ValueError(f"requests[{i}]: a prompt of {len(r.prompt)} tokens plus max_new_tokens="
                             f"{r.max_new_tokens} needs {r.slots + 1} positions, longer than the model's context "
                             f"n_positions={n_positions}; shorten the prompt or lower max_new_tokens")
    return list(requests)


@dataclass
class Result:
    """What one request got: its tokens or its error, and when each token came.

    Times are seconds on the serving clock; ``events`` are its timeline (lane ``"request i"``,
    kinds ``prefill`` then ``decode``, ``micro_batch`` the step: 0 for the prefill, t for token t),
    read by :func:`parallel_lib.viz.timeline.plot_timeline`. ``served_by`` names the rank(s) or
    device(s) that computed it ("" for a request refused before it ran).
    """

    index: int
    tokens: list[int] = field(default_factory=list)
    error: Optional[str] = None
    arrival: float = 0.0
    token_times: list[float] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    served_by: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float:
        """Time to first token: arrival to the first generated token (NaN if none came)."""
        return self.token_times[0] - self.arrival if self.token_times else math.nan

    @property
    def tpot(self) -> float:
        """Time per output token after the first (NaN with fewer than two tokens)."""
        if len(self.token_times) < 2:
            return math.nan
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)


@dataclass
class StepInput:
    """One forward pass of a group: ids (b, s), positions (b, s), cache slots (b, s), the mask
    (b, 1, s, upto) of the slots each query may see, and which query's logits each row keeps."""

    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor
    upto: int
    last: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.ids.shape)  # type: ignore[return-value]

    def to(self, device: torch.device) -> StepInput:
        """The same step with its tensors on ``device`` (each stage reads it where it computes)."""
        return StepInput(*(t.to(device) for t in (self.ids, self.positions, self.slots, self.mask)), self.upto,
                         self.last.to(device))


class Group:
    """Requests served in one batch, their plan (see the module docstring), and their outputs.

    Args:
        requests: the group's requests (already checked).
        indices: each request's index in the whole job (names lanes and results).
        device: where the plan's tensors are built.
    """

    def __init__(self, requests: Sequence[Request], indices: Sequence[int],
                 device: torch.device = torch.device("cpu")) -> None:
        self.requests, self.indices, self.device = list(requests), list(indices), device
        self.lengths = torch.tensor([len(r.prompt) for r in self.requests], device=device)
        self.last_slot = torch.tensor([r.slots - 1 for r in self.requests], device=device)  # last fed token's slot
        self.max_len = max(r.slots for r in self.requests)
        self.steps = max(r.max_new_tokens for r in self.requests)  # forward passes: 1 prefill + steps-1 decodes
        self.results = [Result(i) for i in self.indices]
        self.generators = [torch.Generator().manual_seed(r.seed) for r in self.requests]

    def __len__(self) -> int:
        return len(self.requests)

    def prefill(self) -> StepInput:
        """Step 0: every prompt, right-padded with token 0."""
        b, s = len(self), int(self.lengths.max())
        ids = torch.zeros(b, s, dtype=torch.long, device=self.device)
        for row, r in enumerate(self.requests):
            ids[row, :len(r.prompt)] = torch.tensor(r.prompt, device=self.device)
        positions = torch.arange(s, device=self.device).expand(b, s)
        key = torch.arange(s, device=self.device)
        causal = key[None, :] <= key[:, None]                                   # (s, s): query i sees keys <= i
        inside = key[None, :] < self.lengths[:, None]                           # (b, s): keys of the prompt
        mask = causal[None, None] & inside[:, None, None, :]                    # (b, 1, s, s)
        return StepInput(ids, positions, positions, mask, s, self.lengths - 1)

    def decode(self, step: int, tokens: torch.Tensor) -> StepInput:
        """Decode step ``step`` >= 1: feed ``tokens`` (b,), the tokens sampled at the step before."""
        p = torch.minimum(self.lengths + (step - 1), self.last_slot)           # (b,) slot = position
        upto = int(p.max()) + 1
        mask = torch.arange(upto, device=self.device)[None, :] <= p[:, None]   # (b, upto)
        return StepInput(tokens.view(-1, 1).to(self.device), p[:, None], p[:, None], mask[:, None, None, :], upto,
                         torch.zeros_like(p))

    def active(self, row: int, step: int) -> bool:
        """Whether row ``row`` still wants the token of step ``step`` (not failed, stopped or at its limit)."""
        result, request = self.results[row], self.requests[row]
        if result.error is not None or step >= request.max_new_tokens:
            return False
        return not (result.tokens and request.eos is not None and result.tokens[-1] == request.eos)

    def accept(self, step: int, logits: torch.Tensor, start: float, now: float) -> torch.Tensor:
        """Pick each row's next token from its logits (b, V); record it where the row still wants it.

        The token's time is ``now``; the step that made it ran from ``start`` (one prefill or decode
        event on the request's lane). A row whose pick fails (non-finite logits, say) gets its error
        and stops; the others go on. Returns the tokens to feed at the next step (b,).
        """
        picked = torch.zeros(len(self), dtype=torch.long)
        for row, request in enumerate(self.requests):
            if not self.active(row, step):
                continue
            try:
                picked[row] = sample(logits[row], request.temperature, self.generators[row])
            except (ValueError, RuntimeError) as error:
                self.results[row].error = f"request {self.indices[row]} failed at step {step}: {error}"
                continue
            result = self.results[row]
            result.tokens.append(int(picked[row]))
            result.token_times.append(now)
            result.events.append(Event(f"request {result.index}", "decode" if step else "prefill", step, start, now))
        return picked

    def done(self, step: int) -> bool:
        """Whether no row wants the token of step ``step``."""
        return not any(self.active(row, step) for row in range(len(self)))


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> int:
    """Greedy (``temperature == 0``) or one draw from ``softmax(logits / temperature)`` by its inverse CDF.

    One uniform number per token from the request's own generator: the draw depends on nothing
    but this request's seed and logits, never on its neighbours in the batch. The logits are
    shifted by their maximum before the division, so ``(logits - max) / temperature <= 0`` cannot
    overflow however small the temperature (``1e-320``): the maximum keeps weight 1 and every
    lower logit tends to 0, the greedy token.

    Raises:
        ValueError: the logits are not all finite.
    """
    logits = logits.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(logits).all()):
        raise ValueError("the logits are not finite (NaN or inf)")
    if temperature == 0.0:
        return int(logits.argmax())
    cdf = torch.softmax((logits - logits.max()) / temperature, dim=-1).cumsum(0)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    return int(torch.searchsorted(cdf, u.view(1), right=True).clamp_max(len(cdf) - 1))
