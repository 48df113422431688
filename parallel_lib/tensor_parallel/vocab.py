"""Vocabulary parallelism: the embedding and the loss, each rank holding 1/t of the vocabulary.

GPT-2's embedding (50,257 x 768) is its largest matrix, and its output layer reuses it:
the logits are (batch, sequence, vocabulary), larger than any other activation. Split
by rows of the vocabulary, rank ``r`` holds token ids ``[r·V/t, (r+1)·V/t)``:

- **embedding**: each rank looks up the ids it holds and writes zeros for the others;
  the sum over ranks (``g``, or a reduce-scatter under sequence parallelism) is the
  dense lookup.
- **loss**: the logits stay split. Cross-entropy needs only three numbers per token from
  the whole vocabulary: the maximum (for a stable ``exp``), the sum of ``exp`` and the
  target's logit, each an all-reduce of ``b·s`` values instead of a gather of ``b·s·V``
  (Megatron-LM's ``vocab_parallel_cross_entropy``).

A rank that does not hold an id cannot tell a valid id of another rank from one outside the
vocabulary, so each rank checks every id against the whole vocabulary before any collective:
the ids are the same on every rank of the group, so every rank raises the same error and none is
left waiting in an all-reduce. Labels equal to ``ignore_index`` (-100, Hugging Face's padding
label) count zero loss and get zero gradient, as in ``F.cross_entropy``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallel_lib.tensor_parallel import regions as R
from parallel_lib.tensor_parallel.split import check_divisible, shard

__all__ = ["vocab_range", "VocabParallelEmbedding", "VocabParallelHead", "vocab_parallel_cross_entropy",
           "IGNORE_INDEX"]

IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index, the label Hugging Face gives padding


def vocab_range(vocab_size: int, rank: int, tp: int) -> tuple[int, int]:
    """``[start, end)`` of the token ids rank ``rank`` holds.

    Raises:
        ValueError: ``vocab_size`` not divisible by ``tp`` (pad the vocabulary, as Megatron does).
    """
    local = check_divisible("vocab_size", vocab_size, tp,
                            hint="pad the vocabulary to a multiple of tp (Megatron pads to 128·tp)")
    return rank * local, (rank + 1) * local


def _check_in_vocabulary(ids: torch.Tensor, vocab_size: int, name: str, ignore_index: Optional[int] = None) -> None:
    """Raise on the first id outside ``[0, vocab_size)`` (``ignore_index`` excepted), the same on every rank."""
    bad = (ids < 0) | (ids >= vocab_size)
    if ignore_index is not None:
        bad &= ids != ignore_index
    if bool(bad.any()):
        value = int(ids[bad][0])
        allowed = f" or ignore_index={ignore_index}" if ignore_index is not None else ""
        raise ValueError(f"{name} holds id {value}, outside the vocabulary of {vocab_size} tokens "
                         f"(ids 0..{vocab_size - 1}{allowed}); check the tokenizer's vocabulary against "
                         f"the model's vocab_size")


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of a token embedding; the forward sums the ranks' lookups.

    Args:
        weight: this rank's rows, (V/t, h).
        vocab_start: the first token id this rank holds.
        group: the tensor-parallel group.
        sequence_parallel: reduce-scatter the result along the sequence instead of all-reducing it.
    """

    def __init__(self, weight: torch.Tensor, vocab_start: int, group: Any = None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.vocab_start, self.vocab_end = vocab_start, vocab_start + weight.shape[0]
        self.group, self.sequence_parallel = group, sequence_parallel
        self.label = "embedding"  # for recorded region events

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, group: Any = None, **kwargs: Any) -> VocabParallelEmbedding:
        """This rank's rows of a dense ``nn.Embedding``."""
        tp, rank = R.group_size(group), R.group_rank(group)
        start, _ = vocab_range(embedding.num_embeddings, rank, tp)
        return cls(shard(embedding.weight, 0, rank, tp, "vocab_size"), start, group, **kwargs)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The dense lookup of ``ids``, summed (or reduce-scattered) over the group.

        Raises:
            ValueError: an id outside the whole vocabulary (on every rank: the ids are the same on all).
        """
        _check_in_vocabulary(ids, (self.vocab_end - self.vocab_start) * R.group_size(self.group), "input_ids")
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = F.embedding((ids - self.vocab_start).masked_fill(outside, 0), self.weight)
        local = local.masked_fill(outside.unsqueeze(-1), 0.0)  # another rank holds these ids
        with R.labelled(self.label):
            if self.sequence_parallel:
                return R.reduce_scatter_to_sequence_parallel_region(local, self.group)
            return R.reduce_from_tensor_parallel_region(local, self.group)


def _all_reduce(x: torch.Tensor, op: Any, group: Any) -> torch.Tensor:
    if R.group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, vocab_start: int,
                group: Any, ignore_index: int) -> torch.Tensor:
        logits = logits.float()
        counted = target != ignore_index  # ignored labels: no loss, no gradient
        # [1] the largest logit over the whole vocabulary, for a stable exp (no gradient flows through it)
        top = _all_reduce(logits.max(dim=-1).values, dist.ReduceOp.MAX, group)
        shifted = logits - top.unsqueeze(-1)
        # [2] the target's logit: only the rank that holds the target contributes
        vocab_local = logits.shape[-1]
        mine = (target >= vocab_start) & (target < vocab_start + vocab_local) & counted
        index = (target - vocab_start).clamp(0, vocab_local - 1)
        picked = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1) * mine
        picked = _all_reduce(picked, dist.ReduceOp.SUM, group)
        # [3] the softmax denominator
        exp = shifted.exp()
        total = _all_reduce(exp.sum(dim=-1), dist.ReduceOp.SUM, group)
        ctx.save_for_backward(exp / total.unsqueeze(-1) * counted.unsqueeze(-1), mine, index)
        return (total.log() - picked) * counted

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None, None, None]:
        # d loss / d logit_j = softmax_j - [j is the target]: every term is local to this rank
        softmax, mine, index = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, index.unsqueeze(-1), -mine.to(g.dtype).unsqueeze(-1))
        return g * grad.unsqueeze(-1), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_start: int,
                                 group: Any = None, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Per-token cross-entropy from this rank's slice of the logits, never gathering them.

    Args:
        logits: (..., V/t) this rank's logits, for token ids ``vocab_start ... vocab_start + V/t``.
        target: (...) token ids over the whole vocabulary.
        vocab_start: the first id this rank's logits score.
        group: the tensor-parallel group.
        ignore_index: targets equal to it get loss 0 and gradient 0 (``F.cross_entropy``'s ``ignore_index``).

    Returns:
        (...) the loss of each token, equal on every rank (``F.cross_entropy(..., reduction="none")``
        of the gathered logits); three all-reduces of ``target.numel()`` values.

    Raises:
        ValueError: ``target``'s shape is not ``logits``'s without the last dimension, or a target
            outside the whole vocabulary that is not ``ignore_index`` (on every rank alike).
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"target must have logits' shape without the vocabulary dimension, got logits "
                         f"{tuple(logits.shape)} and target {tuple(target.shape)}")
    _check_in_vocabulary(target, logits.shape[-1] * R.group_size(group), "target", ignore_index)
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, group, ignore_index)


class VocabParallelHead(nn.Module):
    """The output layer on this rank's vocabulary slice: logits (b, s, V/t) and their loss, never gathered.

    GPT-2's head is its embedding (tied), so the head holds the very Parameter of this rank's
    :class:`VocabParallelEmbedding`. The hidden state enters through ``f`` (its gradient is
    summed over the ranks' vocabulary slices) or, under sequence parallelism, an all-gather of
    the sequence.

    Args:
        embedding: this rank's vocabulary-parallel embedding (its weight is the head's).
    """

    def __init__(self, embedding: VocabParallelEmbedding) -> None:
        super().__init__()
        self.weight = embedding.weight
        self.vocab_start, self.group, self.sequence_parallel = embedding.vocab_start, embedding.group, \
            embedding.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with R.labelled("head"):
            if self.sequence_parallel:
                x = R.gather_from_sequence_parallel_region(x, self.group)
            else:
                x = R.copy_to_tensor_parallel_region(x, self.group)
        return F.linear(x, self.weight)  # (b, s, V/t)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``sum(ce · weights) / sum(weights)`` from this rank's logits (:func:`vocab_parallel_cross_entropy`).

        As the dense head's loss: labels -100 count zero loss (but their weight stays in the denominator).
        """
        ce = vocab_parallel_cross_entropy(logits, labels, self.vocab_start, self.group)
        w = torch.ones_like(ce) if weights is None else weights.to(ce.dtype)
        return (ce * w).sum() / w.sum().clamp_min(torch.finfo(ce.dtype).tiny)
