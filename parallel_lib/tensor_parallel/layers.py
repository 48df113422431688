"""Megatron's column- and row-parallel linear layers, built from a dense layer and gathered back.

A linear layer ``Y = X A^T + b`` with ``A`` of shape (out, in) splits two ways over ``t`` ranks:

- **by columns of the output** (``ColumnParallelLinear``): rank ``r`` holds rows
  ``r·out/t ... (r+1)·out/t`` of ``A`` and computes that slice of ``Y``. The input must
  be whole on every rank, so it enters through ``f`` (its gradient is all-reduced).
- **by rows of the input** (``RowParallelLinear``): rank ``r`` holds columns
  ``r·in/t ...`` of ``A``, takes that slice of ``X`` and computes a partial ``Y``; ``g``
  sums the partials. The bias is added once, after the sum.

Column then row (the MLP, attention) needs no communication in between: the column
layer's output slice is exactly the row layer's input slice. With ``sequence_parallel``
the ``f``/``g`` pair becomes all-gather / reduce-scatter along the sequence.

Parameters that every rank holds whole but, under sequence parallelism, sees only a
slice of the sequence for (the row layer's bias, layer norms) are marked with
``param.sequence_parallel = True``: their gradients need an all-reduce over the group
(:func:`parallel_lib.tensor_parallel.sequence.sync_sequence_parallel_grads`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from parallel_lib.tensor_parallel import regions as R
from parallel_lib.tensor_parallel.split import shard

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]


def _gather_along(t: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Every rank's ``t`` concatenated along ``dim`` (no autograd: for gathering weights)."""
    with torch.no_grad():
        return R._all_gather(t.detach(), dim, group)


class ColumnParallelLinear(nn.Module):
    """``Y[:, slice_r] = f(X) A_r^T + b_r``: this rank's slice of the output features.

    Args:
        weight: this rank's rows of ``A``, shape (out/t, in).
        bias: this rank's slice of ``b``, or None.
        group: the tensor-parallel process group (None: the default group).
        gather_output: all-gather the output features, so every rank holds all of ``Y``.
        sequence_parallel: the input is this rank's slice of the sequence; all-gather it
            (instead of ``f``) before the multiply, keep only the slice for backward and gather it
            again there (:func:`.regions.sequence_parallel_linear`, as Megatron-LM does).
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], group: Any = None,
                 gather_output: bool = False, sequence_parallel: bool = False) -> None:
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"weight must be 2-D (out/t, in), got shape {tuple(weight.shape)}")
        self.weight = nn.Parameter(weight.detach().clone())
        self.bias = nn.Parameter(bias.detach().clone()) if bias is not None else None
        self.group, self.gather_output, self.sequence_parallel = group, gather_output, sequence_parallel
        self.label = ""  # the model part it sits in, for recorded region events (:func:`.regions.labelled`)

    @classmethod
    def from_dense(cls, linear: nn.Linear, group: Any = None, **kwargs: Any) -> ColumnParallelLinear:
        """This rank's shard of a dense ``nn.Linear``: rows of its weight, the same slice of its bias.

        Raises:
            ValueError: ``out_features`` not divisible by the group's size.
        """
        tp, rank = R.group_size(group), R.group_rank(group)
        bias = None if linear.bias is None else shard(linear.bias, 0, rank, tp, "out_features")
        return cls(shard(linear.weight, 0, rank, tp, "out_features"), bias, group, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with R.labelled(self.label):
            if self.sequence_parallel:  # gathered for the product, only the slice kept for backward (Megatron)
                y = R.sequence_parallel_linear(x, self.weight, self.bias, self.group)
            else:
                y = F.linear(R.copy_to_tensor_parallel_region(x, self.group), self.weight, self.bias)
            return R.gather_from_tensor_parallel_region(y, self.group) if self.gather_output else y

    def to_dense(self) -> nn.Linear:
        """The whole layer, gathered from every rank of the group (a collective: call it on all)."""
        weight = _gather_along(self.weight, 0, self.group)
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=self.bias is not None)
        with torch.no_grad():
            linear.weight.copy_(weight)
            if self.bias is not None:
                linear.bias.copy_(_gather_along(self.bias, 0, self.group))
        return linear

    def extra_repr(self) -> str:
        return (f"local out={self.weight.shape[0]}, in={self.weight.shape[1]}, "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """``Y = g(X_r A_r^T) + b``: partial products over this rank's input slice, summed once.

    Args:
        weight: this rank's columns of ``A``, shape (out, in/t).
        bias: the whole ``b`` (every rank holds it; it is added after the sum), or None.
        group: the tensor-parallel process group (None: the default group).
        input_is_parallel: the input already is this rank's slice of the features (the
            output of a column-parallel layer); False splits a whole input here.
        sequence_parallel: reduce-scatter the output along the sequence instead of ``g``.
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], group: Any = None,
                 input_is_parallel: bool = True, sequence_parallel: bool = False) -> None:
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"weight must be 2-D (out, in/t), got shape {tuple(weight.shape)}")
        self.weight = nn.Parameter(weight.detach().clone())
        self.bias = nn.Parameter(bias.detach().clone()) if bias is not None else None
        if self.bias is not None and sequence_parallel:
            self.bias.sequence_parallel = True  # sees only this rank's slice of the sequence
        self.group, self.input_is_parallel, self.sequence_parallel = group, input_is_parallel, sequence_parallel
        self.label = ""  # the model part it sits in, for recorded region events (:func:`.regions.labelled`)

    @classmethod
    def from_dense(cls, linear: nn.Linear, group: Any = None, **kwargs: Any) -> RowParallelLinear:
        """This rank's shard of a dense ``nn.Linear``: columns of its weight, all of its bias.

        Raises:
            ValueError: ``in_features`` not divisible by the group's size.
        """
        tp, rank = R.group_size(group), R.group_rank(group)
        return cls(shard(linear.weight, 1, rank, tp, "in_features"), linear.bias, group, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = x.chunk(R.group_size(self.group), -1)[R.group_rank(self.group)]
        partial = F.linear(x, self.weight)  # bias later: added once, not once per rank
        with R.labelled(self.label):
            if self.sequence_parallel:
                y = R.reduce_scatter_to_sequence_parallel_region(partial, self.group)
            else:
                y = R.reduce_from_tensor_parallel_region(partial, self.group)
        return y + self.bias if self.bias is not None else y

    def to_dense(self) -> nn.Linear:
        """The whole layer, gathered from every rank of the group (a collective: call it on all)."""
        weight = _gather_along(self.weight, 1, self.group)
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=self.bias is not None)
        with torch.no_grad():
            linear.weight.copy_(weight)
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear

    def extra_repr(self) -> str:
        return (f"out={self.weight.shape[0]}, local in={self.weight.shape[1]}, "
                f"sequence_parallel={self.sequence_parallel}")

