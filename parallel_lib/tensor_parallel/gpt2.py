"""GPT-2 split by heads: one rank's shard of the model, and its forward pass.

One block, as Megatron-LM splits it (``f``/``g`` from :mod:`.regions`)::

    x ─ ln_1 ─ f ─ c_attn (column: my heads of q, k, v) ─ attention on my heads ─ c_proj (row) ─ g ─ + x
    x ─ ln_2 ─ f ─ c_fc   (column: 4h/t features) ─ gelu ─ mlp_proj (row) ─ g ─ + x

so a block costs two all-reduces of (b, s, h) forward (the two ``g``) and two backward
(the two ``f``). With ``sequence_parallel`` the residual stream, the layer norms and the
dropouts hold 1/t of the sequence; ``f``/``g`` become all-gather / reduce-scatter.

The same forward runs with any linear modules: our column/row layers, plain
``nn.Linear`` (a dense model) or ``nn.Linear`` that PyTorch's DTensor ``parallelize_module``
has split (:mod:`.dtensor`), which is how the three are compared on one code path.

**Dropout.** Replicated activations must get the same mask on every rank, and split ones
(my heads, my slice of the sequence) the mask one process would draw there. Each dropout
here draws the mask of the *whole* tensor from a generator seeded by (seed, call, site)
and keeps this rank's slice, so any tensor-parallel size, with or without sequence
parallelism, drops exactly what one process drops. Megatron instead gives each rank its own
random stream inside the split region (cheaper, not comparable bit for bit).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from parallel_lib.tensor_parallel import regions as R
from parallel_lib.tensor_parallel.vocab import vocab_parallel_cross_entropy

__all__ = ["ParallelBlock", "TensorParallelGPT2", "sync_sequence_parallel_grads"]


class _Dropout:
    """Masks keyed by (seed, forward call, site): the whole tensor's mask, then this rank's slice."""

    def __init__(self, seed: int) -> None:
        self.seed, self.calls, self.site = seed, 0, 0

    def start_forward(self) -> None:
        self.calls, self.site = self.calls + 1, 0

    def __call__(self, x: torch.Tensor, p: float, training: bool, dim: int = 1, index: int = 0,
                 parts: int = 1) -> torch.Tensor:
        if not training or p == 0.0:
            return x
        self.site += 1
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.calls * 10_007 + self.site)
        full = list(x.shape)
        full[dim] *= parts
        keep = torch.rand(full, generator=generator).narrow(dim, index * x.shape[dim], x.shape[dim]) >= p
        return x * keep.to(x.device, x.dtype) / (1.0 - p)


class ParallelBlock(nn.Module):
    """One transformer block whose four linear layers may be split (see the module docstring)."""

    def __init__(self, ln_1: nn.LayerNorm, c_attn: nn.Module, c_proj: nn.Module, ln_2: nn.LayerNorm,
                 c_fc: nn.Module, mlp_proj: nn.Module, head_dim: int) -> None:
        super().__init__()
        self.ln_1, self.c_attn, self.c_proj = ln_1, c_attn, c_proj
        self.ln_2, self.c_fc, self.mlp_proj = ln_2, c_fc, mlp_proj
        self.head_dim = head_dim

    def forward(self, x: torch.Tensor, mask_bias: torch.Tensor, model: TensorParallelGPT2) -> torch.Tensor:
        b, tp, rank = x.shape[0], model.tp, model.rank
        sp_parts, sp_index = (tp, rank) if model.sequence_parallel else (1, 0)
        with R.region_label("attention"):
            q, k, v = self.c_attn(self.ln_1(x)).chunk(3, dim=-1)  # (b, s, h/t) each: my heads
            s = q.shape[1]  # the whole sequence, also under sequence parallelism
            q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))  # (b, heads/t, s, d)
            scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim) + mask_bias
            probs = model.dropout(scores.softmax(dim=-1), model.attn_pdrop, self.training, 1, rank, tp)
            y = (probs @ v).transpose(1, 2).reshape(b, s, -1)  # (b, s, h/t)
            x = x + model.dropout(self.c_proj(y), model.resid_pdrop, self.training, 1, sp_index, sp_parts)
        with R.region_label("mlp"):
            hidden = F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh")  # GPT-2's gelu_new
            x = x + model.dropout(self.mlp_proj(hidden), model.resid_pdrop, self.training, 1, sp_index, sp_parts)
        return x


class TensorParallelGPT2(nn.Module):
    """One rank's shard of a GPT-2 LM (built by :func:`.convert.tensor_parallelize`).

    ``forward(input_ids, attention_mask)`` returns this rank's logits ``(b, s, V/t)``
    (all of them when ``vocab_parallel`` is False); :meth:`loss` computes the weighted
    cross-entropy from them without gathering.
    """

    def __init__(self, config: Any, wte: nn.Module, wpe: nn.Embedding, blocks: list[ParallelBlock],
                 ln_f: nn.LayerNorm, group: Any = None, sequence_parallel: bool = False,
                 vocab_parallel: bool = True, vocab_start: int = 0, dropout_seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.wte, self.wpe, self.h, self.ln_f = wte, wpe, nn.ModuleList(blocks), ln_f
        self.group, self.sequence_parallel, self.vocab_parallel = group, sequence_parallel, vocab_parallel
        self.tp, self.rank = R.group_size(group), R.group_rank(group)
        self.vocab_start = vocab_start
        self.attn_pdrop, self.resid_pdrop, self.embd_pdrop = config.attn_pdrop, config.resid_pdrop, config.embd_pdrop
        self.dropout = _Dropout(dropout_seed)
        if sequence_parallel:  # whole on every rank, but each sees a slice of the sequence
            for module in [self.wpe, self.ln_f] + [m for blk in blocks for m in (blk.ln_1, blk.ln_2)]:
                for p in module.parameters():
                    p.sequence_parallel = True

    def _mask_bias(self, s: int, attention_mask: Optional[torch.Tensor], dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
        """(b or 1, 1, s, s): 0 where a query may attend to a key (causal, not padding), else a large negative."""
        allowed = torch.ones(s, s, dtype=torch.bool, device=device).tril()[None, None]
        if attention_mask is not None:
            allowed = allowed & attention_mask.bool()[:, None, None, :]
        return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        b, s = input_ids.shape
        if self.sequence_parallel and s % self.tp:
            raise ValueError(f"sequence parallelism needs a sequence length divisible by tp={self.tp}, "
                             f"got {s}; pad the batch to a multiple of {self.tp}")
        if self.training:
            self.dropout.start_forward()
        sp_parts, sp_index = (self.tp, self.rank) if self.sequence_parallel else (1, 0)
        with R.region_label("embedding"):
            local_s = s // sp_parts
            positions = torch.arange(sp_index * local_s, (sp_index + 1) * local_s, device=input_ids.device)
            x = self.wte(input_ids) + self.wpe(positions)  # (b, s/sp_parts, h)
            x = self.dropout(x, self.embd_pdrop, self.training, 1, sp_index, sp_parts)
        mask_bias = self._mask_bias(s, attention_mask, x.dtype, x.device)
        for block in self.h:
            x = block(x, mask_bias, self)
        with R.region_label("head"):
            x = self.ln_f(x)
            if not self.vocab_parallel:
                return F.linear(x, self.wte.weight)
            if self.sequence_parallel:
                x = R.gather_from_sequence_parallel_region(x, self.group)
            else:
                x = R.copy_to_tensor_parallel_region(x, self.group)
            return F.linear(x, self.wte.weight)  # the head is the embedding, tied: (b, s, V/t)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``sum(ce · weights) / sum(weights)`` from this rank's logits (the course's weighted loss)."""
        if self.vocab_parallel:
            ce = vocab_parallel_cross_entropy(logits, labels, self.vocab_start, self.group)
        else:
            ce = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none").view(labels.shape)
        w = weights.to(ce.dtype)
        return (ce * w).sum() / w.sum().clamp_min(torch.finfo(ce.dtype).tiny)


def sync_sequence_parallel_grads(model: nn.Module) -> int:
    """All-reduce, over the tensor-parallel group, the gradients of parameters marked ``sequence_parallel``.

    Under sequence parallelism a layer norm (or the row layers' bias, the position
    embedding) sees only this rank's slice of the sequence, so its gradient is a partial
    sum. Call after ``backward`` and before the optimizer step. Returns the number of
    gradients reduced (0 without sequence parallelism).
    """
    group = getattr(model, "group", None)
    grads = [p.grad for p in model.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if grads and R.group_size(group) > 1:
        flat = torch.cat([g.flatten() for g in grads])  # one all-reduce for all of them
        torch.distributed.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
    return len(grads)
