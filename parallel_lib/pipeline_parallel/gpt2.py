"""GPT-2 as an ``nn.Sequential`` of pipeline stages, split by a device map.

:class:`~parallel_lib.pipeline_parallel.Pipe` needs a sequence of modules that each take
and return one tensor. Hugging Face's ``GPT2LMHeadModel`` is one module whose
forward does everything, so here it is cut, following the same device map as
chapter 03, into: embeddings (token + position) and the first blocks on the first
device, further blocks on the next devices, final layer norm and LM head on the
last one. The stages reuse the model's own modules, so the pipeline trains the
very weights chapter 03 placed by hand.

Tied weights. GPT-2's LM head *is* the token-embedding matrix. In a pipeline the
embedding sits on the first stage and the head on the last, possibly on two
devices, so one tensor cannot serve both. As Megatron-LM does, the last stage gets
its own copy of the matrix, and after every backward pass both copies receive the
sum of their gradients (``Pipe`` does this for the pairs in ``tied_parameters``).
Starting equal and updated with equal gradients, the copies stay equal, and the
loss and gradients are those of the tied model.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch
from torch import Tensor, nn
from transformers import GPT2LMHeadModel

from parallel_lib.model_parallel.device_map import DeviceMap
from parallel_lib.models.attention import allowed_keys
from parallel_lib.pipeline_parallel.microbatch import split_layers
from parallel_lib.runtime.device import DeviceKey

__all__ = ["GPT2Embedding", "GPT2Blocks", "GPT2Head", "GPT2Stages", "gpt2_stages", "lm_loss"]


def _positions(hidden: Tensor) -> Tensor:
    return torch.arange(hidden.size(1), device=hidden.device).unsqueeze(0)  # (1, T)


class GPT2Embedding(nn.Module):
    """Token ids (B, T) -> hidden states (B, T, C): token plus position embeddings."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, input_ids: Tensor) -> Tensor:
        tokens = self.wte(input_ids)  # (B, T, C)
        return self.drop(tokens + self.wpe(_positions(tokens)))


class GPT2Blocks(nn.Module):
    """A run of consecutive transformer blocks, (B, T, C) -> (B, T, C), causal attention."""

    def __init__(self, blocks: Sequence[nn.Module], config: object) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.config = config

    def forward(self, hidden: Tensor) -> Tensor:
        positions = _positions(hidden)
        # an additive causal mask, (1, 1, T, T): 0 where a query may see a key, the dtype's
        # minimum elsewhere. Built here, not by transformers' mask helpers, whose names and
        # arguments changed between 4.53 and 5.x; eager and SDPA attention both add it
        allowed = allowed_keys(hidden.shape[1], device=hidden.device)
        mask = torch.zeros(allowed.shape, dtype=hidden.dtype, device=hidden.device).masked_fill(
            ~allowed, torch.finfo(hidden.dtype).min)
        for block in self.blocks:
            # by name: the arguments' positions differ between transformers 4.53 and 5.x, and
            # 4.53 returns a tuple (hidden states first)
            out = block(hidden, attention_mask=mask, position_ids=positions)
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden


class GPT2Head(nn.Module):
    """Final layer norm and LM head: (B, T, C) -> logits (B, T, vocab)."""

    def __init__(self, ln_f: nn.Module, lm_head: nn.Linear) -> None:
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, hidden: Tensor) -> Tensor:
        return self.lm_head(self.ln_f(hidden))


class GPT2Stages(nn.Sequential):
    """The stages of one GPT-2, in pipeline order.

    Attributes:
        devices: the device key of each stage: pass ``stages.devices`` to ``Pipe``.
        blocks: the block indices each stage holds, in stage order.
        tied_parameters: ``[(embedding weight, head weight)]`` when the model ties them
            (read by :class:`~parallel_lib.pipeline_parallel.Pipe`), else empty.
    """

    def __init__(self, stages: Sequence[nn.Module], devices: list[DeviceKey], blocks: list[list[int]],
                 tied_parameters: list[tuple[nn.Parameter, nn.Parameter]]) -> None:
        super().__init__(*stages)
        self.devices = devices
        self.blocks = blocks
        self.tied_parameters = tied_parameters


def gpt2_stages(model: GPT2LMHeadModel, devices: Union[Sequence[DeviceKey], DeviceMap]) -> GPT2Stages:
    """Cut a GPT-2 LM into one ``nn.Sequential`` stage per device of a device map.

    Run it as ``Pipe(stages, stages.devices, chunks=...)``. Modules are
    shared with ``model``, except the LM head of a tied model, which becomes a copy
    (see the module docstring). Nothing is moved: ``Pipe`` places each stage.

    Args:
        model: a ``GPT2LMHeadModel`` (e.g. from :func:`parallel_lib.common.models.build_gpt2`).
        devices: one device key per stage, blocks balanced as by
            :func:`~parallel_lib.model_parallel.device_map.get_device_map`, or a device map
            ``{device: [block indices]}``.

    Returns:
        ``GPT2Stages``: stage 0 = embeddings + its blocks, last = its blocks + ln_f + head.

    Raises:
        TypeError: ``model`` is not a ``GPT2LMHeadModel``.
        ValueError: more devices than blocks, or a map that does not cover the blocks in order.
    """
    if not isinstance(model, GPT2LMHeadModel):
        raise TypeError(f"model must be a GPT2LMHeadModel, got {type(model).__name__}")
    keys, blocks = split_layers(len(model.transformer.h), devices, "blocks")

    transformer = model.transformer
    head, tied = model.lm_head, []
    if head.weight is transformer.wte.weight:
        head = nn.Linear(head.in_features, head.out_features, bias=False)
        head.weight = nn.Parameter(transformer.wte.weight.detach().clone())
        tied = [(transformer.wte.weight, head.weight)]

    stages = []
    for s, layers in enumerate(blocks):
        parts: list[nn.Module] = []
        if s == 0:
            parts.append(GPT2Embedding(transformer.wte, transformer.wpe, transformer.drop))
        parts.append(GPT2Blocks([transformer.h[k] for k in layers], model.config))
        if s == len(blocks) - 1:
            parts.append(GPT2Head(transformer.ln_f, head))
        stages.append(nn.Sequential(*parts))
    return GPT2Stages(stages, keys, blocks, tied)


def lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean next-token cross-entropy over all tokens; ``labels`` (B, T) are already shifted.

    Labels of -100 are ignored. Every row then counts as many tokens as it has
    non-ignored labels, so for a pipeline's micro-batch weights to be exact, either
    ignore nothing or use a summed loss with ``Pipe.train_step(..., reduction="sum")``.
    """
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
