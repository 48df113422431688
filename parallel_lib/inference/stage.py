"""One piece of GPT-2 for serving: a run of layers, maybe split by heads, with or without the ends.

Every strategy runs the same forward (:func:`block_step`), only on different pieces:

==============  ===============================================================
single, dp      one :class:`Stage` with every layer, the embedding and the head
mp              one stage per device of chapter 03's device map, in one process
pp              one stage per rank; the first embeds, the last holds the head
tp              one stage per rank with every layer split by heads (chapter 07)
==============  ===============================================================

A block is chapter 07's :class:`~parallel_lib.tensor_parallel.gpt2.ParallelBlock`: its four
linear layers are plain ``nn.Linear`` (dense) or chapter 07's column/row-parallel layers built
from the same dense weights, ``c_attn`` cut by heads (:func:`~parallel_lib.tensor_parallel.split.qkv_rows`).
The attention below runs on whatever heads the block holds, so there is one attention
function for every strategy. A row-parallel layer sums its partial products with one
all-reduce (chapter 07's ``g``), so a split block costs exactly two all-reduces per forward:
after the attention's projection and after the MLP. The embedding and the head stay whole on
every tensor-parallel rank, so nothing else communicates.

Hugging Face ties GPT-2's head to the token embedding. In one process the head uses the
embedding's own weight (chapter 03's choice: the final hidden state travels back to the
first device); a last pipeline stage on another rank keeps a copy of it, as Megatron-LM
does (it then all-reduces the two copies' gradients, which serving never needs).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from parallel_lib.inference.batch import StepInput
from parallel_lib.inference.kv_cache import KVCache
from parallel_lib.tensor_parallel import regions as R
from parallel_lib.tensor_parallel.convert import dense_linear
from parallel_lib.tensor_parallel.gpt2 import ParallelBlock
from parallel_lib.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from parallel_lib.tensor_parallel.split import check_divisible, qkv_rows

__all__ = ["attend", "block_step", "Stage", "build_stage"]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scaled dot-product attention over the heads given: q (b, h, s, d), k and v (b, h, T, d), mask (b, 1, s, T)."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])                 # (b, h, s, T)
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return scores.softmax(dim=-1) @ v                                        # (b, h, s, d)


def block_step(block: ParallelBlock, x: torch.Tensor, step: StepInput, cache: KVCache, layer: int) -> torch.Tensor:
    """One transformer block on the new tokens ``x`` (b, s, n_embd), reading and extending ``cache``."""
    b, s, _ = x.shape
    q, k, v = block.c_attn(block.ln_1(x)).chunk(3, dim=-1)                  # (b, s, heads·d) each: my heads
    q, k, v = (t.view(b, s, -1, block.head_dim).transpose(1, 2) for t in (q, k, v))  # (b, heads, s, d)
    cache.write(layer, step.slots, k, v)
    keys, values = cache.read(layer, b, step.upto)                          # (b, heads, upto, d)
    y = attend(q, keys, values, step.mask).transpose(1, 2).reshape(b, s, -1)  # (b, s, heads·d)
    x = x + block.c_proj(y)                                                 # row-parallel: all-reduce 1
    return x + block.mlp_proj(F.gelu(block.c_fc(block.ln_2(x)), approximate="tanh"))  # all-reduce 2


class Stage(nn.Module):
    """A run of GPT-2 layers on one device; the first stage embeds tokens, the last gives logits.

    Args:
        blocks: ``{global layer index: block}`` in order.
        heads: attention heads each block holds (``n_head / tp`` when split).
        device: where the stage computes.
        embed: ``(wte, wpe)`` on the first stage, else None.
        head: ``(ln_f, weight)`` on the last stage (``weight``: its own copy of the embedding, or None
            with ``tied_to``), else None.
        lane: the name of this stage's lane in timelines (a device or a rank).
        tied_to: the first stage's token embedding, whose weight the head uses (one process).
    """

    def __init__(self, blocks: dict[int, ParallelBlock], heads: int, device: torch.device,
                 embed: Optional[tuple[nn.Embedding, nn.Embedding]] = None,
                 head: Optional[tuple[nn.LayerNorm, Optional[nn.Parameter]]] = None, lane: str = "",
                 tied_to: Optional[nn.Embedding] = None) -> None:
        super().__init__()
        self.layers = list(blocks)
        self.blocks = nn.ModuleList(blocks.values())
        self.heads, self.device, self.lane = heads, device, lane or str(device)
        self.head_dim = self.blocks[0].head_dim if len(self.blocks) else 0
        self.width = self.blocks[0].ln_1.normalized_shape[0] if len(self.blocks) else 0  # n_embd
        self.wte, self.wpe = embed if embed is not None else (None, None)
        self.ln_f, self._head_weight = head if head is not None else (None, None)
        # another stage's embedding, kept outside the module's parameters: its bytes are that stage's
        self.__dict__["_tied_to"] = tied_to

    @property
    def first(self) -> bool:
        return self.wte is not None

    @property
    def last(self) -> bool:
        return self.ln_f is not None

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype = torch.float32) -> KVCache:
        """A KV cache for this stage's layers and heads, on its device."""
        return KVCache(self.layers, batch, self.heads, max_len, self.head_dim, dtype, self.device)

    @torch.no_grad()
    def forward(self, step: StepInput, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Token ids (first stage) or hidden states in; hidden states, or logits (b, V) on the last stage, out."""
        x, step = x.to(self.device), step.to(self.device)
        if self.first:
            x = self.wte(x) + self.wpe(step.positions)                      # (b, s, n_embd)
        for layer, block in zip(self.layers, self.blocks):
            x = block_step(block, x, step, cache, layer)
        if not self.last:
            return x
        rows = torch.arange(x.shape[0], device=x.device)
        x = self.ln_f(x[rows, step.last])                                   # (b, n_embd): the query each row keeps
        weight = self.head_weight
        return F.linear(x.to(weight.device), weight)                        # (b, V)

    @property
    def head_weight(self) -> Optional[torch.Tensor]:
        """The head's weight: this stage's own, or the first stage's embedding it is tied to (one process)."""
        tied = self.__dict__.get("_tied_to")
        return tied.weight if tied is not None else self._head_weight


def _split_block(hf_block: nn.Module, head_dim: int, n_head: int, group: Any) -> ParallelBlock:
    """Chapter 07's split of one Hugging Face block over ``group``: c_attn by heads, the MLP by columns/rows."""
    tp, rank = R.group_size(group), R.group_rank(group)
    attn, mlp = hf_block.attn, hf_block.mlp
    c_attn = dense_linear(attn.c_attn)
    rows = qkv_rows(c_attn.in_features, n_head, rank, tp)
    return ParallelBlock(copy.deepcopy(hf_block.ln_1),
                         ColumnParallelLinear(c_attn.weight[rows], c_attn.bias[rows], group),
                         RowParallelLinear.from_dense(dense_linear(attn.c_proj), group), copy.deepcopy(hf_block.ln_2),
                         ColumnParallelLinear.from_dense(dense_linear(mlp.c_fc), group),
                         RowParallelLinear.from_dense(dense_linear(mlp.c_proj), group), head_dim)


def _dense_block(hf_block: nn.Module, head_dim: int) -> ParallelBlock:
    attn, mlp = hf_block.attn, hf_block.mlp
    return ParallelBlock(copy.deepcopy(hf_block.ln_1), dense_linear(attn.c_attn), dense_linear(attn.c_proj),
                         copy.deepcopy(hf_block.ln_2), dense_linear(mlp.c_fc), dense_linear(mlp.c_proj), head_dim)


def build_stage(model: nn.Module, layers: Sequence[int], device: torch.device, first: bool, last: bool,
                tp: bool = False, group: Any = None, lane: str = "",
                embed: Optional[tuple[nn.Embedding, nn.Embedding]] = None) -> Stage:
    """A :class:`Stage` holding ``layers`` of a Hugging Face ``GPT2LMHeadModel`` on ``device`` (weights copied).

    Args:
        model: the dense model (not changed).
        layers: global indices of the layers to hold, consecutive.
        device: where the stage computes.
        first, last: hold the embedding / the final layer norm and head.
        tp: split every block by heads over ``group`` (``torch.distributed`` must be initialised).
        group: the tensor-parallel group (None: the default group).
        lane: the stage's timeline lane.
        embed: the first stage's ``(wte, wpe)`` when the head must use that very weight (one process);
            None makes the last stage copy it.

    Raises:
        ValueError: ``n_head`` not divisible by the group's size.
    """
    config, t = model.config, model.transformer
    head_dim, heads = config.n_embd // config.n_head, config.n_head
    if tp:
        heads = check_divisible("n_head", config.n_head, R.group_size(group),
                                hint="choose a tensor-parallel size that divides the number of heads")
        blocks = {i: _split_block(t.h[i], head_dim, config.n_head, group) for i in layers}
    else:
        blocks = {i: _dense_block(t.h[i], head_dim) for i in layers}
    own_embed = (copy.deepcopy(t.wte).to(device), copy.deepcopy(t.wpe).to(device)) if first else None
    head, tied_to = None, None
    if last:
        if own_embed is not None:
            weight = own_embed[0].weight  # tied, as in the Hugging Face model
        elif embed is not None:
            weight, tied_to = None, embed[0]
        else:
            weight = nn.Parameter(t.wte.weight.detach().clone().to(device))
        head = (copy.deepcopy(t.ln_f).to(device), weight)
    stage = Stage(blocks, heads, device, own_embed, head, lane, tied_to)
    for block in stage.blocks:
        block.to(device)
    return stage.eval()
