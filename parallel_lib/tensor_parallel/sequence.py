"""What sequence parallelism adds to a tensor-parallel model besides its collectives.

Under sequence parallelism (Korthikanti et al. 2022) the residual stream between the
column/row pairs holds 1/t of the sequence on each rank. Two things follow:

- the **position embedding** must add the positions of this rank's slice, not ``0..s/t-1``:
  :class:`SequenceParallelPositions` takes the whole sequence's positions and keeps its slice;
- parameters every rank holds whole but applies to its slice only (layer norms, the row
  layers' bias, the position table) get a **partial gradient**: they are marked
  ``param.sequence_parallel = True`` and :func:`sync_sequence_parallel_grads` sums them over
  the group after ``backward``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from parallel_lib.common.models import PositionEmbedding
from parallel_lib.tensor_parallel import regions as R

__all__ = ["SequenceParallelPositions", "mark_sequence_parallel", "sync_sequence_parallel_grads"]


class SequenceParallelPositions(PositionEmbedding):
    """GPT-2's position table on a sequence-parallel rank: embeds only this rank's slice of the positions.

    Built by :meth:`from_dense` (the same weight, marked ``sequence_parallel``).
    """

    group: Any = None

    @classmethod
    def from_dense(cls, wpe: nn.Embedding, group: Any) -> SequenceParallelPositions:
        """``wpe`` itself, re-classed (its weight is kept and marked ``sequence_parallel``)."""
        wpe.__class__ = cls
        wpe.group = group
        mark_sequence_parallel(wpe)
        return wpe  # type: ignore[return-value]

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        tp, s = R.group_size(self.group), positions.shape[-1]
        if s % tp:
            raise ValueError(f"sequence parallelism needs a sequence length divisible by tp={tp}, got {s}; "
                             f"pad the batch to a multiple of {tp}")
        whole = super().forward(positions)  # checks the length against the model's positions
        return whole.chunk(tp, dim=-2)[R.group_rank(self.group)]  # (..., s/t, h): my tokens


def mark_sequence_parallel(module: nn.Module) -> None:
    """Mark every parameter of ``module`` as seeing only this rank's slice of the sequence."""
    for p in module.parameters():
        p.sequence_parallel = True


def sync_sequence_parallel_grads(model: nn.Module, group: Any = None) -> int:
    """All-reduce, over the tensor-parallel group, the gradients of parameters marked ``sequence_parallel``.

    Call after ``backward`` and before the optimizer step.

    Args:
        model: a model split by :func:`~parallel_lib.tensor_parallel.parallelize.parallelize_tp` (or any
            module with marked parameters).
        group: the tensor-parallel group (default: the one ``parallelize_tp`` recorded on the model).

    Returns:
        The number of gradients reduced (0 without sequence parallelism).
    """
    info = getattr(model, "tp_info", None)
    group = group if group is not None else getattr(info, "group", getattr(model, "group", None))
    grads = [p.grad for p in model.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if grads and R.group_size(group) > 1:
        flat = torch.cat([g.flatten() for g in grads])  # one all-reduce for all of them
        torch.distributed.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
    return len(grads)
