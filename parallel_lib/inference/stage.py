"""One piece of GPT-2 for serving: a run of the one model's blocks, maybe split by heads, with or without the ends.

Every strategy runs the same forward: the one GPT-2's blocks (:mod:`parallel_lib.models`), each
given the engine's KV cache for the pass (``cache.at(slots, upto)``, the model's ``KVStore``)
and the mask of the slots each query may see. Only the pieces differ:

==============  ===============================================================
single, dp      one :class:`Stage` with every layer, the embedding and the head
mp              one stage per device of chapter 03's device map, in one process
pp              one stage per rank; the first embeds, the last holds the head
tp              one stage per rank with every block split by heads (chapter 07)
==============  ===============================================================

A split block is chapter 07's (:func:`~parallel_lib.tensor_parallel.parallelize.split_block`):
``c_attn`` cut by heads, the MLP by columns and rows; the model's attention runs on whatever
heads the block holds. A row-parallel layer sums its partial products with one all-reduce
(chapter 07's ``g``), so a split block costs exactly two all-reduces per forward: after the
attention's projection and after the MLP. The embedding and the head stay whole on every
tensor-parallel rank, so nothing else communicates.

A stage keeps copies of its own parts only, on its device, in the model's dtype (fp32, bf16
or fp16): the census of a stage is what it holds. The head is tied to the token embedding.
In one process the head uses the first stage's embedding itself (chapter 03's choice: the
final hidden state travels back to the first device); a last pipeline stage on another rank
keeps a copy of it, as Megatron-LM does (it then all-reduces the two copies' gradients,
which serving never needs).
"""

from __future__ import annotations

import copy
from typing import Any, Optional, Sequence

import torch
from torch import nn

from parallel_lib.inference.batch import StepInput
from parallel_lib.inference.kv_cache import KVCache
from parallel_lib.models.gpt2 import Block, LMHead
from parallel_lib.models.hf import as_gpt2
from parallel_lib.tensor_parallel import regions as R
from parallel_lib.tensor_parallel.parallelize import split_block
from parallel_lib.tensor_parallel.split import check_divisible

__all__ = ["Stage", "build_stage"]


class Stage(nn.Module):
    """A run of the one GPT-2's blocks on one device; the first stage embeds tokens, the last gives logits.

    Args:
        blocks: the blocks, in order (each knows its global layer index, ``block.layer``).
        heads: attention heads each block holds (``n_head / tp`` when split).
        device: where the stage computes.
        embed: ``(wte, wpe)`` on the first stage, else None.
        head: ``(ln_f, lm_head)`` on the last stage (``lm_head`` None with ``tied_to``), else None.
        lane: the name of this stage's lane in timelines (a device or a rank).
        tied_to: the first stage's token embedding, whose weight the head uses (one process).
    """

    def __init__(self, blocks: Sequence[Block], heads: int, device: torch.device,
                 embed: Optional[tuple[nn.Module, nn.Module]] = None,
                 head: Optional[tuple[nn.LayerNorm, Optional[LMHead]]] = None, lane: str = "",
                 tied_to: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.layers = [block.layer for block in self.blocks]
        self.heads, self.device, self.lane = heads, device, lane or str(device)
        self.head_dim = self.blocks[0].attn.head_dim if len(self.blocks) else 0
        self.width = self.blocks[0].ln_1.normalized_shape[0] if len(self.blocks) else 0  # n_embd
        self.wte, self.wpe = embed if embed is not None else (None, None)
        self.ln_f, self.lm_head = head if head is not None else (None, None)
        if tied_to is not None:  # another stage's embedding, kept outside this module's parameters:
            # its bytes are that stage's
            self.__dict__["_tied_head"] = LMHead(tied_to.weight)

    @property
    def first(self) -> bool:
        return self.wte is not None

    @property
    def last(self) -> bool:
        return self.ln_f is not None

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the stage's parameters (and of the hidden states it sends)."""
        return next(self.parameters()).dtype

    @property
    def head(self) -> Optional[LMHead]:
        """The head: this stage's own, or one on the first stage's embedding it is tied to (one process)."""
        return self.__dict__.get("_tied_head") or self.lm_head

    def new_cache(self, batch: int, max_len: int, dtype: Optional[torch.dtype] = None) -> KVCache:
        """A KV cache for this stage's layers and heads, on its device, in the model's dtype by default."""
        return KVCache(self.layers, batch, self.heads, max_len, self.head_dim, dtype or self.dtype, self.device)

    @torch.no_grad()
    def forward(self, step: StepInput, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Token ids (first stage) or hidden states in; hidden states, or logits (b, V) on the last stage, out."""
        x, step = x.to(self.device), step.to(self.device)
        if self.first:
            x = self.wte(x) + self.wpe(step.positions)                      # (b, s, n_embd)
        store = cache.at(step.slots, step.upto)                             # the model's KVStore for this pass
        for block in self.blocks:
            x = block(x, step.mask, store)
        if not self.last:
            return x
        rows = torch.arange(x.shape[0], device=x.device)
        x = self.ln_f(x[rows, step.last])                                   # (b, n_embd): the query each row keeps
        head = self.head
        return head(x.to(head.weight.device))                               # (b, V)


def build_stage(model: Any, layers: Sequence[int], device: torch.device, first: bool, last: bool,
                tp: bool = False, group: Any = None, lane: str = "", tied_to: Optional[nn.Module] = None) -> Stage:
    """A :class:`Stage` holding ``layers`` of a GPT-2 on ``device`` (its own copies; the model is not changed).

    Args:
        model: the one GPT-2 or a Hugging Face ``GPT2LMHeadModel`` (dense).
        layers: global indices of the layers to hold, consecutive.
        device: where the stage computes.
        first, last: hold the embedding / the final layer norm and head.
        tp: split every block by heads over ``group`` (``torch.distributed`` must be initialised).
        group: the tensor-parallel group (None: the default group).
        lane: the stage's timeline lane.
        tied_to: the first stage's token embedding when the head must use that very weight (one
            process); None makes the last stage copy it.

    Raises:
        ValueError: ``n_head`` not divisible by the group's size.
    """
    one = as_gpt2(model)
    config, t = one.config, one.transformer
    heads = config.n_head
    if tp:
        heads = check_divisible("n_head", config.n_head, R.group_size(group),
                                hint="choose a tensor-parallel size that divides the number of heads")
    blocks = []
    for i in layers:  # copy and move one block at a time: the stage never holds more than its own
        block = copy.deepcopy(t.h[i]).to(device)
        blocks.append(split_block(block, group) if tp else block)
    own_embed = (copy.deepcopy(t.wte).to(device), copy.deepcopy(t.wpe).to(device)) if first else None
    head = None
    if last:
        if own_embed is not None:
            lm_head = LMHead(own_embed[0].weight)  # tied, as in the model
        elif tied_to is not None:
            lm_head = None
        else:
            lm_head = LMHead(nn.Parameter(t.wte.weight.detach().clone().to(device)))
        head = (copy.deepcopy(t.ln_f).to(device), lm_head)
    return Stage(blocks, heads, device, own_embed, head, lane, tied_to).eval()
