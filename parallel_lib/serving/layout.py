"""One forward pass's batch over the paged cache: which token goes in which row, which slot it writes, what it sees.

A step feeds each of ``b`` sequences its tokens ``start .. stop-1`` (a whole prompt, a chunk of one,
one decode token, or a speculative draft's ``k + 1`` tokens). :func:`step_layout` lays them out in
one of two ways (the engine chooses, :meth:`~parallel_lib.serving.engine.ServingEngine.flatten`):

- *flat*: one row holding every sequence's new tokens one after another (``S = Σ fed``) and every
  sequence's keys one after another (``T = Σ stop``); a query may see its own sequence's keys up to
  its position, nothing of the others (vLLM's layout, with a mask instead of its kernel);
- *padded*: a row per sequence, its new tokens right-padded to the longest feed and its keys to the
  longest sequence; padding queries see nothing and padding keys are seen by no one.

Everything is built with tensor operations from the block tables, never token by token in Python:
on a CPU a small model's step is dominated by such bookkeeping (a step of 16 decodes over 100-token
sequences built its slot lists one token at a time took a third of the step's time).
"""

from __future__ import annotations

from dataclasses import astuple, dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

__all__ = ["StepLayout", "step_layout", "flat_is_cheaper", "paged_forward"]


@dataclass
class StepLayout:
    """The tensors of one step (R rows of S new tokens and T keys; b sequences).

    Attributes:
        ids, positions, write, valid: (R, S) the new tokens, their positions, the pool slots they write,
            True on real tokens (False on padding).
        read: (R, T) the pool slot of every key a row's queries may see (padding: any slot).
        allowed: (R, 1, S, T) True where a query may attend to a key.
        rows, cols: (b,) where each sequence's last new token is.
    """

    ids: torch.Tensor
    positions: torch.Tensor
    write: torch.Tensor
    valid: torch.Tensor
    read: torch.Tensor
    allowed: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor

    def astuple(self) -> tuple[torch.Tensor, ...]:
        return astuple(self)


def _slots(table: torch.Tensor, owner: Optional[torch.Tensor], pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """Pool slots of positions ``pos``: ``table[owner, pos // bs] · bs + pos % bs`` (owner None: row by row)."""
    block = pos.div(block_size, rounding_mode="floor")
    picked = table.gather(1, block) if owner is None else table[owner, block]
    return picked * block_size + pos.remainder(block_size)


def step_layout(tables: Sequence[Sequence[int]], tokens: Sequence[Sequence[int]], starts: Sequence[int],
                stops: Sequence[int], block_size: int, flat: bool,
                device: Optional[torch.device] = None) -> StepLayout:
    """The layout of one step (see the module docstring).

    Args:
        tables: each sequence's block table (holding at least ``stop`` tokens).
        tokens: each sequence's new tokens (``stop - start`` of them).
        starts, stops: each sequence's first new position and its length after the step.
        block_size: slots per block.
        flat: one row (flat) or a row per sequence (padded).
        device: where the tensors go (default: the CPU).

    Raises:
        ValueError: a sequence feeds no token, or its tokens do not match ``stop - start``.
    """
    fed = [stop - start for start, stop in zip(starts, stops)]
    if any(f < 1 or len(t) != f for f, t in zip(fed, tokens)):
        raise ValueError(f"each sequence must feed stop - start >= 1 tokens, got starts={list(starts)}, "
                         f"stops={list(stops)}, tokens of lengths {[len(t) for t in tokens]}")
    b, width = len(tables), max(len(t) for t in tables)
    table = torch.tensor([list(t) + [0] * (width - len(t)) for t in tables], dtype=torch.long)  # (b, blocks)
    start_t, stop_t, fed_t = (torch.tensor(v, dtype=torch.long) for v in (starts, stops, fed))
    new_ids = torch.tensor([t for seq in tokens for t in seq], dtype=torch.long)
    if flat:
        S, T = sum(fed), sum(stops)
        seqs = torch.arange(b)
        q_owner, k_owner = seqs.repeat_interleave(fed_t), seqs.repeat_interleave(stop_t)       # (S,), (T,)
        q_first, k_first = fed_t.cumsum(0) - fed_t, stop_t.cumsum(0) - stop_t                  # where each begins
        positions = start_t[q_owner] + torch.arange(S) - q_first[q_owner]
        key_pos = torch.arange(T) - k_first[k_owner]
        allowed = (q_owner[:, None] == k_owner[None, :]) & (key_pos[None, :] <= positions[:, None])
        out = StepLayout(new_ids[None], positions[None], _slots(table, q_owner, positions, block_size)[None],
                         torch.ones(1, S, dtype=torch.bool), _slots(table, k_owner, key_pos, block_size)[None],
                         allowed[None, None], torch.zeros(b, dtype=torch.long), fed_t.cumsum(0) - 1)
    else:
        S, T = max(fed), max(stops)
        column = torch.arange(S)[None, :]                                                      # (1, S)
        valid = column < fed_t[:, None]                                                        # (b, S)
        positions = torch.where(valid, start_t[:, None] + column, 0)
        key_pos = torch.arange(T)[None, :].expand(b, T)
        seen = key_pos < stop_t[:, None]                                                       # (b, T) real keys
        allowed = seen[:, None, :] & (key_pos[:, None, :] <= positions[:, :, None]) & valid[:, :, None]
        ids = torch.zeros(b, S, dtype=torch.long).masked_scatter(valid, new_ids)
        out = StepLayout(ids, positions, _slots(table, None, positions, block_size), valid,
                         _slots(table, None, torch.where(seen, key_pos, 0), block_size), allowed[:, None],
                         torch.arange(b), fed_t - 1)
    if device is not None and torch.device(device) != out.ids.device:
        out = StepLayout(*(t.to(device) for t in out.astuple()))
    return out


def flat_is_cheaper(fed: Sequence[int], lengths: Sequence[int], hidden: int) -> bool:
    """Whether a step feeding ``fed`` tokens to sequences of ``lengths`` (after the step) computes less flat.

    Per layer and token row the projections and the MLP cost about ``12 h`` multiply-adds per feature,
    and each attention score about 2: flat computes ``sum(fed)`` rows and ``sum(fed) · sum(len)``
    scores (every query against every sequence's keys, most masked), padded ``b · max(fed)`` rows and
    ``b · max(fed) · max(len)`` scores. Decodes alone are cheaper padded; a prompt beside them, flat.
    """
    flat = sum(fed) * 12 * hidden + 2 * sum(fed) * sum(lengths)
    padded = len(fed) * max(fed) * 12 * hidden + 2 * len(fed) * max(fed) * max(lengths)
    return flat < padded


def paged_forward(model, store, layout: StepLayout) -> torch.Tensor:
    """The one GPT-2's blocks over ``layout`` with KV store ``store``: the final hidden states (R, S, h).

    A flat row may be longer than ``n_positions`` (many prompts side by side): every position in it is
    a real one, so the position table is read without the embedding's length check.
    """
    body = model.transformer
    x = body.wte(layout.ids) + F.embedding(layout.positions, body.wpe.weight)  # (R, S, h)
    for block in body.h:
        x = block(x, layout.allowed, store)
    return body.ln_f(x)
