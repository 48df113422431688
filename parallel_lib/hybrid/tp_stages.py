"""A pipeline stage made of tensor-parallel layers: chapter 07's shard, cut as chapter 04 cuts GPT-2.

Every rank builds the same dense GPT-2, splits it by heads for its tensor-parallel group
(:func:`~parallel_lib.tensor_parallel.tensor_parallelize`) and keeps the blocks of its
pipeline stage (:func:`~parallel_lib.pipeline_parallel.microbatch.split_layers`, the
balance chapters 04 and 05 use)::

    stage 0:      ids  -> vocab-parallel embedding (g) + positions -> blocks[0:k]          -> hidden
    stage j:      hidden -> blocks[...]                                                     -> hidden
    stage p-1:    hidden -> blocks[...] -> ln_f -> f -> logits of my vocabulary slice (b, s, V/t)

The hidden states between stages are whole on every rank of a tensor-parallel group (the
row layer's ``g`` has summed them), so slice t of stage j sends to slice t of stage j+1.

Tied embedding. The head is the embedding matrix. With one stage it is the same
parameter; over several, the last stage gets a copy of its vocabulary slice (as
:func:`~parallel_lib.pipeline_parallel.gpt2.gpt2_stages` does for the whole matrix), and
the two copies' gradients are summed between first and last stage of the same slice
(:class:`~parallel_lib.hybrid.gradients.StageGradients`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from parallel_lib.pipeline_parallel.microbatch import split_layers
from parallel_lib.tensor_parallel import regions as R
from parallel_lib.tensor_parallel.gpt2 import TensorParallelGPT2
from parallel_lib.tensor_parallel.vocab import vocab_parallel_cross_entropy

__all__ = ["TensorParallelStage", "stage_blocks", "stage_loss", "owned_names", "dense_state"]


def stage_blocks(n_layer: int, pp: int) -> list[list[int]]:
    """The block indices of each of ``pp`` stages (chapter 04's balance)."""
    return split_layers(n_layer, ["cpu"] * pp, "blocks")[1]


class TensorParallelStage(nn.Module):
    """Stage ``j`` of ``pp`` of a :class:`TensorParallelGPT2` shard; ``forward`` maps ids or hidden states on.

    Args:
        model: this rank's shard of the whole model (only the stage's layers are kept as modules).
        j: the stage.
        pp: number of stages.

    Attributes:
        tied: this stage's copy of the tied embedding (first stage: the embedding, last stage:
            the head's copy; empty in between and when one stage holds both, which share one parameter).
    """

    def __init__(self, model: TensorParallelGPT2, j: int, pp: int) -> None:
        super().__init__()
        self.first, self.last = j == 0, j == pp - 1
        self.blocks_index = stage_blocks(len(model.h), pp)[j]
        self.h = nn.ModuleList(model.h[k] for k in self.blocks_index)
        self._model = [model]  # in a list: not registered, its other stages' layers are not ours
        self.tied: list[nn.Parameter] = []
        if self.first:
            self.wte, self.wpe = model.wte, model.wpe
        if self.last:
            self.ln_f = model.ln_f
            if self.first:
                self.head = model.wte.weight  # one stage: the head IS the embedding
            else:
                self.head = nn.Parameter(model.wte.weight.detach().clone())
        if pp > 1:
            self.tied = [self.wte.weight] if self.first else [self.head] if self.last else []

    @property
    def model(self) -> TensorParallelGPT2:
        return self._model[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        model = self.model
        # sequence parallelism: the residual stream between blocks, and so between stages, is
        # this rank's 1/tp of the sequence, (b, s/tp, h); the embedding reduce-scatters into it
        parts, index = (model.tp, model.rank) if model.sequence_parallel else (1, 0)
        if self.first:
            if x.shape[1] % parts:
                raise ValueError(f"sequence parallelism needs a sequence length divisible by tp={parts}, "
                                 f"got {x.shape[1]}")
            with R.region_label("embedding"):
                local = x.shape[1] // parts
                positions = torch.arange(index * local, (index + 1) * local, device=x.device)
                x = self.wte(x) + self.wpe(positions)
        # causal only: the batches are right-padded, so a real token never sees padding, and
        # padded positions carry zero loss weight
        mask_bias = model._mask_bias(x.shape[1] * parts, None, x.dtype, x.device)
        for block in self.h:
            x = block(x, mask_bias, model)
        if self.last:
            with R.region_label("head"):
                x = self.ln_f(x)
                x = (R.gather_from_sequence_parallel_region(x, model.group) if model.sequence_parallel
                     else R.copy_to_tensor_parallel_region(x, model.group))
                x = F.linear(x, self.head)  # (b, s, V/t): my vocabulary slice's logits
        return x


def stage_loss(stage: TensorParallelStage, labels: torch.Tensor, weights: torch.Tensor,
               denominator: float) -> Any:
    """The last stage's loss function for one micro-batch: ``sum(ce · w) / denominator``, logits never gathered."""
    model = stage.model

    def loss(logits: torch.Tensor, labels: torch.Tensor = labels, weights: torch.Tensor = weights) -> torch.Tensor:
        ce = vocab_parallel_cross_entropy(logits, labels, model.vocab_start, model.group)
        return (ce * weights.to(ce.dtype)).sum() / denominator

    return loss


def owned_names(stage: TensorParallelStage, pp: int) -> list[str]:
    """The dense model's parameter names this stage trains (``lm_head.weight``: the last stage's copy)."""
    names = [f"transformer.h.{k}.{rest}" for k in stage.blocks_index
             for rest in ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
                          "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                          "mlp.c_proj.weight", "mlp.c_proj.bias")]
    if stage.first:
        names += ["transformer.wte.weight", "transformer.wpe.weight"]
    if stage.last:
        names += ["transformer.ln_f.weight", "transformer.ln_f.bias"] + (["lm_head.weight"] if pp > 1 else [])
    return names


def dense_state(stage: TensorParallelStage, pp: int, gathered: Optional[nn.Module]) -> dict[str, torch.Tensor]:
    """The stage's trained parameters by the dense model's names, from ``gather_dense`` of the shard.

    The last stage's head copy is not in the shard's model: its slices are gathered here
    (a collective of the tensor-parallel group, like ``gather_dense``).
    """
    if gathered is None:
        return {}
    state = {k: v.detach().clone() for k, v in gathered.state_dict().items()}
    if stage.last and pp > 1:
        state["lm_head.weight"] = R._all_gather(stage.head.detach(), 0, stage.model.group).cpu().clone()
    return {name: state[name] for name in owned_names(stage, pp)}
