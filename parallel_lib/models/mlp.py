"""GPT-2's feed-forward part: widen 4x, GELU (the tanh approximation GPT-2 was trained with), narrow.

A module of its own so a parallelism swaps it whole or in part: tensor parallelism cuts
``c_fc`` by columns and ``c_proj`` by rows; a mixture of experts replaces it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from parallel_lib.models.dropout import DropoutStream, SeededDropout
from parallel_lib.models.linear import Conv1D

__all__ = ["MLP"]


class MLP(nn.Module):
    """``dropout(c_proj(gelu(c_fc(x))))`` (Hugging Face's names).

    Args:
        config: a ``GPT2Config`` (``n_embd``, ``n_inner``, ``resid_pdrop``).
        stream, site: the model's dropout stream and this dropout's site number.
    """

    def __init__(self, config: Any, stream: DropoutStream, site: int) -> None:
        super().__init__()
        inner = config.n_inner or 4 * config.n_embd
        self.c_fc = Conv1D(config.n_embd, inner)
        self.c_proj = Conv1D(inner, config.n_embd)
        self.dropout = SeededDropout(config.resid_pdrop, stream, site)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))  # GPT-2's gelu_new
