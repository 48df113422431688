"""GPT-2's causal self-attention: one module for training, the KV-cached engine and any split by heads.

::

    x (b, s, h) ─ c_attn ─ q | k | v ─ heads (b, n, s, d) ─ [cache: append k, v; read all] ─
        softmax(q kᵀ / √d  where allowed) ─ dropout ─ · v ─ (b, s, n·d) ─ c_proj ─ dropout ─ y

The number of heads ``n`` is read from ``c_attn``'s output (its width / 3 / d), never from
the config, so the same code runs every head (one process) or one rank's heads (tensor
parallelism swaps ``c_attn`` and ``c_proj`` for column- and row-parallel layers).

**What a query may see** is one boolean tensor ``allowed`` (b or 1, 1, s, T): True where
query ``i`` may attend to key ``j``. :func:`allowed_keys` builds it from a padding mask
(left or right padding alike) for a whole sequence; the inference engine builds its own
for cached decoding, where the T keys are the cache's slots.

**The cache** is anything with ``update(layer, k, v) -> (keys, values)`` (:class:`KVStore`):
it stores the new tokens' keys and values of layer ``layer`` and returns every key and value
the queries may attend to. The engine's :class:`~parallel_lib.inference.kv_cache.KVCache`
gives one per forward pass (``cache.at(slots, upto)``).

The softmax runs in fp32 whatever the parameters' dtype (bf16 and fp16 scores would lose the
small probabilities), then returns to it: fp32 models are unchanged by this.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

import torch
from torch import nn

from parallel_lib.models.dropout import DropoutStream, SeededDropout
from parallel_lib.models.linear import Conv1D

__all__ = ["KVStore", "allowed_keys", "CausalSelfAttention"]


class KVStore(Protocol):
    """The cache attention needs: store this step's keys and values, return all it may attend to."""

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``k, v`` (b, heads, s, d) of layer ``layer`` in; keys and values (b, heads, T, d) out."""
        ...


def allowed_keys(s: int, attention_mask: Optional[torch.Tensor] = None,
                 device: Optional[torch.device] = None) -> torch.Tensor:
    """(b or 1, 1, s, s) booleans: query ``i`` may see key ``j`` when ``j <= i`` and ``j`` is not padding.

    Args:
        s: the sequence length.
        attention_mask: (b, s) with 1 on tokens and 0 on padding (either side), or None.
        device: where to build it (default: the mask's, else the CPU).

    Raises:
        ValueError: ``attention_mask`` is not (b, s).
    """
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape[1] != s:
            raise ValueError(f"attention_mask must be (batch, {s}) with 1 on tokens and 0 on padding, got shape "
                             f"{tuple(attention_mask.shape)}")
        device = attention_mask.device
    causal = torch.ones(s, s, dtype=torch.bool, device=device).tril()[None, None]  # (1, 1, s, s)
    if attention_mask is None:
        return causal
    return causal & attention_mask.bool()[:, None, None, :]  # (b, 1, s, s)


class CausalSelfAttention(nn.Module):
    """GPT-2's attention of block ``layer`` (Hugging Face's names: ``c_attn``, ``c_proj``).

    Args:
        config: a ``GPT2Config`` (``n_embd``, ``n_head``, ``attn_pdrop``, ``resid_pdrop``).
        layer: this block's index in the whole model (the cache's key).
        stream: the model's dropout stream; ``sites``: the numbers of the two dropout sites
            (the probabilities, then the output).
    """

    def __init__(self, config: Any, layer: int, stream: DropoutStream, sites: tuple[int, int]) -> None:
        super().__init__()
        self.layer, self.head_dim = layer, config.n_embd // config.n_head
        self.c_attn = Conv1D(config.n_embd, 3 * config.n_embd)
        self.c_proj = Conv1D(config.n_embd, config.n_embd)
        self.attn_dropout = SeededDropout(config.attn_pdrop, stream, sites[0])
        self.resid_dropout = SeededDropout(config.resid_pdrop, stream, sites[1])

    def forward(self, x: torch.Tensor, allowed: torch.Tensor, cache: Optional[KVStore] = None) -> torch.Tensor:
        """``x`` (b, s, h) and ``allowed`` (b or 1, 1, s, T) in; the attention's output (b, s, h) out."""
        qkv = self.c_attn(x)                                                     # (b, s, 3·n·d): my heads
        b, s = qkv.shape[:2]  # s: the whole sequence, also when x holds a slice of it (sequence parallelism)
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=-1))  # (b, n, s, d)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)                                # (b, n, T, d)
        scores = (q @ k.transpose(-1, -2)) * self.head_dim ** -0.5              # (b, n, s, T)
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        probs = self.attn_dropout(scores.softmax(dim=-1, dtype=torch.float32).to(v.dtype))
        y = (probs @ v).transpose(1, 2).reshape(b, s, -1)                        # (b, s, n·d)
        return self.resid_dropout(self.c_proj(y))
