"""One expert: GPT-2's feed-forward network (widen, GELU, narrow), without its dropout.

Every expert has the shape of the dense MLP it replaces (Switch Transformer, Mixtral), so
the mixture with one expert, top-1 and no capacity limit *is* the dense model. Dropout is
applied once, to the layer's combined output, by the layer (:class:`~.moe.MoE`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parallel_lib.common.checks import positive_int
from parallel_lib.models.linear import Conv1D
from parallel_lib.models.mlp import MLP

__all__ = ["Expert"]


class Expert(nn.Module):
    """``c_proj(gelu(c_fc(x)))`` with Hugging Face's names, ``hidden -> inner -> hidden``.

    Raises:
        ValueError: a width below 1.
    """

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.c_fc = Conv1D(positive_int("hidden", hidden), positive_int("inner", inner))
        self.c_proj = Conv1D(inner, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))  # the dense MLP's gelu_new

    @classmethod
    def from_mlp(cls, mlp: MLP) -> "Expert":
        """An expert holding a copy of a dense :class:`~parallel_lib.models.mlp.MLP`'s weights."""
        if not isinstance(mlp, MLP):
            raise TypeError(f"mlp must be the one GPT-2's MLP (parallel_lib.models.MLP), got {type(mlp).__name__}")
        hidden, inner = mlp.c_fc.weight.shape
        expert = cls(hidden, inner).to(mlp.c_fc.weight.dtype)
        expert.load_state_dict({k: v for k, v in mlp.state_dict().items() if k.startswith(("c_fc", "c_proj"))})
        return expert
