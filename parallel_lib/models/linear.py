"""A linear layer stored the way Hugging Face's GPT-2 stores it: weight (in, out).

OpenAI's GPT-2 checkpoint (and so Hugging Face's ``Conv1D``) keeps every weight of the
blocks as (in_features, out_features), the transpose of ``nn.Linear``'s (out, in). Keeping
that layout here makes the one model's state dict *the same tensors* as Hugging Face's,
so ``load_state_dict`` works both ways with no conversion to get wrong. The forward is the
same single ``addmm`` Hugging Face runs, so the two models round identically.

Tensor parallelism (chapter 07) replaces these layers by its column and row layers, which
use ``nn.Linear``'s layout; :meth:`Conv1D.linear_weight` gives the transpose they cut.
"""

from __future__ import annotations

import torch
from torch import nn

from parallel_lib.common.checks import positive_int

__all__ = ["Conv1D"]


class Conv1D(nn.Module):
    """``y = x W + b`` with ``W`` of shape (in, out): GPT-2's linear layer.

    Args:
        in_features, out_features: the sizes of ``x``'s and ``y``'s last dimension.

    Raises:
        ValueError: a size below 1.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features = positive_int("in_features", in_features)
        self.out_features = positive_int("out_features", out_features)
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)  # (tokens, out)
        return y.view(*x.shape[:-1], self.out_features)

    def linear_weight(self) -> torch.Tensor:
        """The weight in ``nn.Linear``'s layout (out, in): a detached copy."""
        return self.weight.detach().t().contiguous()

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features} (weight stored (in, out), as Hugging Face's Conv1D)"
