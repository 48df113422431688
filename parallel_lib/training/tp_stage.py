"""A pipeline stage made of tensor-parallel layers: chapter 07's shard, cut as chapter 04 cuts GPT-2.

Every rank builds the same dense GPT-2, splits it by heads for its tensor-parallel group
(:func:`~parallel_lib.tensor_parallel.tensor_parallelize`, the one GPT-2 of
:mod:`parallel_lib.models` with chapter 07's parts swapped in) and runs the blocks of its
pipeline stage (:func:`~parallel_lib.pipeline_parallel.microbatch.stage_blocks`, the balance
chapters 04 and 05 use): a slice of ``model.transformer.h`` plus the ends::

    stage 0:      ids  -> vocab-parallel embedding (g) + positions -> blocks[0:k]          -> hidden
    stage j:      hidden -> blocks[...]                                                     -> hidden
    stage p-1:    hidden -> blocks[...] -> ln_f -> f -> logits of my vocabulary slice (b, s, V/t)

The hidden states between stages are whole on every rank of a tensor-parallel group (the
row layer's ``g`` has summed them), so slice t of stage j sends to slice t of stage j+1.

Tied embedding. The head is the embedding matrix. With one stage it is the same
parameter; over several, the last stage gets a copy of its vocabulary slice (as
:func:`~parallel_lib.pipeline_parallel.gpt2.gpt2_stages` does for the whole matrix), and
the two copies' gradients are summed between first and last stage of the same slice
(:func:`~parallel_lib.training.run.train` gives each copy a ZeRO group of its own and all-reduces
its reduced shard over ``pm.group("tied")``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from parallel_lib.context_parallel.layout import shard_positions
from parallel_lib.models.attention import allowed_keys
from parallel_lib.models.gpt2 import GPT2
from parallel_lib.pipeline_parallel.microbatch import stage_blocks
from parallel_lib.tensor_parallel import regions as R
from parallel_lib.tensor_parallel.vocab import VocabParallelHead, vocab_parallel_cross_entropy

__all__ = ["TensorParallelStage", "stage_loss", "owned_names", "dense_state"]


class TensorParallelStage(nn.Module):
    """Stage ``j`` of ``pp`` of a tensor-parallel GPT-2; ``forward`` maps ids or hidden states on.

    Args:
        model: this rank's shard of the whole model (the one GPT-2 after ``parallelize_tp``; only
            the stage's layers are kept as modules).
        j: the stage.
        pp: number of stages.

    Attributes:
        tied: this stage's copy of the tied embedding (first stage: the embedding, last stage:
            the head's copy; empty in between and when one stage holds both, which share one parameter).

    Raises:
        ValueError: ``model`` is not split by ``parallelize_tp`` with ``vocab_parallel=True``.
    """

    def __init__(self, model: GPT2, j: int, pp: int) -> None:
        super().__init__()
        info = getattr(model, "tp_info", None)
        if info is None or not info.vocab_parallel:
            raise ValueError("model must be tensor-parallel (tensor_parallelize or parallelize_tp) with "
                             "vocab_parallel=True")
        self.first, self.last = j == 0, j == pp - 1
        t = model.transformer
        self.blocks_index = stage_blocks(len(t.h), pp)[j]
        self.h = nn.ModuleList(t.h[k] for k in self.blocks_index)
        self._model = [model]  # in a list: not registered, its other stages' layers are not ours
        self.tied: list[nn.Parameter] = []
        if self.first:
            self.wte, self.wpe, self.drop = t.wte, t.wpe, t.drop
        if self.last:
            self.ln_f = t.ln_f
            self.head = model.lm_head  # one stage: the head IS the embedding
            if not self.first:
                self.head = VocabParallelHead(t.wte)
                self.head.weight = nn.Parameter(t.wte.weight.detach().clone())  # the last stage's own copy
        if pp > 1:
            self.tied = [self.wte.weight] if self.first else [self.head.weight] if self.last else []

    @property
    def model(self) -> GPT2:
        return self._model[0]

    def hidden_shape(self, batch: int, seq_len: int) -> tuple[int, int, int]:
        """The hidden states a stage hands on for ``batch`` sequences of ``seq_len`` tokens.

        ``(batch, seq_len, n_embd)``, or ``seq_len / tp`` tokens under sequence parallelism:
        each rank then holds its slice of the sequence between blocks, and so between stages.
        """
        info = self.model.tp_info
        return batch, seq_len // (info.tp if info.sequence_parallel else 1), self.model.config.n_embd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        info = self.model.tp_info
        # the whole sequence's length: under sequence parallelism the hidden states between blocks,
        # and so between stages, hold this rank's 1/tp of it (the embedding reduce-scatters into it)
        s = x.shape[1] if self.first or not info.sequence_parallel else x.shape[1] * info.tp
        if self.first:  # the model's own embedding (this stage's wte, wpe, drop); under cp, my tokens' positions
            x = self.model.transformer.embed(x, self._positions(x))
        # causal only: the batches are right-padded, so a real token never sees padding, and
        # padded positions carry zero loss weight
        allowed = allowed_keys(s, None, x.device)
        for block in self.h:
            x = block(x, allowed)
        if self.last:  # f, or the all-gather of the sequence, then my vocabulary slice's logits (b, s, V/t)
            x = self.head(self.ln_f(x))
        return x


    def _positions(self, ids: torch.Tensor) -> Optional[torch.Tensor]:
        """The positions of the tokens ``ids`` holds: None (0..s-1), or this cp rank's shard's (``parallelize_cp``)."""
        info = getattr(self.model, "cp_info", None)
        if info is None:
            return None
        return shard_positions(ids.shape[1] * info.cp, info.cp, info.index, info.layout, ids.device)


def stage_loss(stage: TensorParallelStage, labels: torch.Tensor, weights: torch.Tensor,
               denominator: float) -> Any:
    """The last stage's loss function for one micro-batch: ``sum(ce · w) / denominator``, logits never gathered."""
    info = stage.model.tp_info

    def loss(logits: torch.Tensor, labels: torch.Tensor = labels, weights: torch.Tensor = weights) -> torch.Tensor:
        ce = vocab_parallel_cross_entropy(logits, labels, info.vocab_start, info.group)
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
        state["lm_head.weight"] = R._all_gather(stage.head.weight.detach(), 0, stage.model.tp_info.group).cpu().clone()
    return {name: state[name] for name in owned_names(stage, pp)}
