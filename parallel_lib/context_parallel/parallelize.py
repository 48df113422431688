"""Context parallelism applied to the one GPT-2: its attention swapped for ring attention over ``cp``, in place.

Everything in a GPT-2 block but attention works token by token: the layer norms, the
projections ``c_attn`` and ``c_proj``, the MLP and the head never mix positions. So a rank
that holds s/cp of the tokens (and *all* the weights) can run the whole model on them,
provided attention sees every key. :func:`parallelize_cp` swaps each block's attention core
(scores, softmax, values) for :func:`.ring.ring_attention` over the mesh's ``cp`` group and
leaves every parameter where it was::

    x (b, s/cp, h) ─ c_attn ─ q | k | v (b, n, s/cp, d) ─ ring attention (all keys, causal by position) ─ c_proj

Each rank feeds the model its tokens and their positions (:func:`cp_shard`: the layout's
chunks of the ids, and ``positions=`` for the position embedding). Its logits are its tokens'
logits; its parameter gradients are its tokens' share, so summing them over ``cp`` (as a
data-parallel all-reduce does, over the flattened ``("dp", "cp")`` group) gives one process's.

Not covered (refused with a ValueError): dropout (its masks are drawn per whole tensor and the
zig-zag shard is not one slice of it), a padding mask, and a KV cache (decoding is inference's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from parallel_lib.common.checks import check_choice, positive_int, positive_number
from parallel_lib.context_parallel.layout import LAYOUTS, shard_positions, shard_sequence
from parallel_lib.context_parallel.ring import cp_group_of, ring_attention
from parallel_lib.models.attention import CausalSelfAttention
from parallel_lib.models.gpt2 import GPT2

__all__ = ["CPInfo", "RingSelfAttention", "parallelize_cp", "cp_shard"]


@dataclass(frozen=True)
class CPInfo:
    """How a model was made context-parallel (``model.cp_info``)."""

    group: Any
    cp: int
    index: int        # this rank's place along cp
    layout: str


class RingSelfAttention(nn.Module):
    """GPT-2's attention with the same ``c_attn`` and ``c_proj`` (same parameter names), attending by ring.

    Args:
        attention: the block's :class:`~parallel_lib.models.attention.CausalSelfAttention` (its layers are kept).
        info: the model's :class:`CPInfo`; block, timeout: as :func:`.ring.ring_attention`.
    """

    def __init__(self, attention: CausalSelfAttention, info: CPInfo, block: int, timeout: float) -> None:
        super().__init__()
        self.layer, self.head_dim = attention.layer, attention.head_dim
        self.c_attn, self.c_proj = attention.c_attn, attention.c_proj
        self.info, self.block, self.timeout = info, block, timeout

    def forward(self, x: torch.Tensor, allowed: torch.Tensor, cache: Optional[Any] = None) -> torch.Tensor:
        """``x`` (b, s/cp, h), this rank's tokens; ``allowed`` is ignored but for its batch size (no padding)."""
        if cache is not None:
            raise ValueError("a context-parallel model does not decode with a KV cache; generate with the dense model")
        if allowed.shape[0] != 1:
            raise ValueError("attention_mask (padding) is not supported under context parallelism: "
                             "pack the sequences without padding")
        qkv = self.c_attn(x)                                                      # (b, s/cp, 3·n·d)
        b, s = qkv.shape[:2]
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=-1))  # (b, n, s/cp, d)
        y = ring_attention(q, k, v, self.info.group, causal=True, layout=self.info.layout, block=self.block,
                           timeout=self.timeout)
        return self.c_proj(y.transpose(1, 2).reshape(b, s, -1))                   # (b, s/cp, h)


def parallelize_cp(model: GPT2, mesh_or_group: Any, layout: str = "zigzag", block: int = 64,
                   timeout: float = 60.0) -> GPT2:
    """Swap every block's attention of ``model`` for ring attention over ``cp``, in place (module docstring).

    Args:
        model: the one :class:`~parallel_lib.models.GPT2`, dense, without dropout.
        mesh_or_group: a built mesh (its ``cp`` group) or the group itself.
        layout: which tokens each rank holds, "zigzag" (balanced under the causal mask) or "contiguous".
        block: tile size of attention; timeout: seconds any exchange may wait.

    Returns:
        ``model``, with ``model.cp_info`` (:class:`CPInfo`).

    Raises:
        TypeError: not the one GPT2; ``mesh_or_group`` is None.
        ValueError: already context-parallel; a dropout probability above 0; bad layout, block or timeout.
    """
    if not isinstance(model, GPT2):
        raise TypeError(f"model must be the one GPT2 (parallel_lib.models.build_model), got {type(model).__name__}")
    if getattr(model, "cp_info", None) is not None:
        raise ValueError("model is already context-parallel (model.cp_info is set); parallelize the dense model")
    for name in ("attn_pdrop", "resid_pdrop", "embd_pdrop"):
        if getattr(model.config, name, 0.0):
            raise ValueError(f"context parallelism here needs dropout off: config.{name}="
                             f"{getattr(model.config, name)}; build the model with {name}=0")
    group = cp_group_of(mesh_or_group)
    check_choice("layout", layout, LAYOUTS)
    positive_int("block", block)
    positive_number("timeout", timeout)
    info = CPInfo(group, dist.get_world_size(group), dist.get_rank(group), layout)
    for block_module in model.transformer.h:
        block_module.attn = RingSelfAttention(block_module.attn, info, block, float(timeout))
    model.cp_info = info
    return model


def cp_shard(model: GPT2, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens of ``input_ids`` (b, s) and their positions: ``model(ids, positions=positions)``.

    Raises:
        ValueError: ``model`` is not context-parallel; ``s`` not divisible by ``2·cp``.
    """
    info: Optional[CPInfo] = getattr(model, "cp_info", None)
    if info is None:
        raise ValueError("model is not context-parallel: call parallelize_cp(model, mesh) first")
    ids = shard_sequence(input_ids, info.cp, info.index, info.layout, dim=1)
    return ids, shard_positions(input_ids.shape[1], info.cp, info.index, info.layout, input_ids.device)
