"""To and from Hugging Face's ``GPT2LMHeadModel``: the same state dict, loaded into the other class.

Nothing is renamed or transposed: the one GPT-2 stores Hugging Face's names and layout
(:mod:`.linear`), so both directions are ``load_state_dict`` and are exact. A split model
(tensor parallelism) has other tensors: gather it back to a dense one first.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GPT2LMHeadModel

from parallel_lib.models.gpt2 import GPT2
from parallel_lib.models.linear import Conv1D

__all__ = ["from_hf", "to_hf", "as_gpt2"]


def from_hf(hf_model: Any, dropout_seed: int = 0) -> GPT2:
    """The one GPT-2 holding a copy of ``hf_model``'s parameters (same dtype, device and train/eval mode).

    ``dropout_seed`` seeds its dropout masks (:mod:`.dropout`).

    Raises:
        TypeError: ``hf_model`` is not a Hugging Face ``GPT2LMHeadModel``.
        ValueError: its config uses a setting the one model does not implement.
    """
    if not isinstance(hf_model, GPT2LMHeadModel):
        raise TypeError(f"hf_model must be a Hugging Face GPT2LMHeadModel (e.g. build_gpt2('tiny')), got "
                        f"{type(hf_model).__name__}")
    first = next(hf_model.parameters())
    model = GPT2(hf_model.config, seed=dropout_seed).to(first.device, first.dtype)
    model.load_state_dict(hf_model.state_dict())
    return model.train(hf_model.training)


def to_hf(model: GPT2) -> GPT2LMHeadModel:
    """A Hugging Face ``GPT2LMHeadModel`` holding a copy of ``model``'s parameters.

    Raises:
        TypeError: ``model`` is not a :class:`GPT2`, or has split parts (gather them back first).
    """
    if not isinstance(model, GPT2):
        raise TypeError(f"model must be the one GPT2 (parallel_lib.models), got {type(model).__name__}")
    dense = [type(b.attn.c_attn) is Conv1D and type(b.mlp.c_fc) is Conv1D for b in model.transformer.h]
    if not all(dense) or type(model.transformer.wte) is not torch.nn.Embedding:
        raise TypeError("model has split parts (tensor-parallel layers); gather it into a dense model first "
                        "(parallel_lib.tensor_parallel.gather_dense)")
    first = next(model.parameters())
    with torch.random.fork_rng(devices=[]):
        hf = GPT2LMHeadModel(model.config).to(first.device, first.dtype)
    hf.load_state_dict(model.state_dict())
    hf.tie_weights()
    return hf.train(model.training)


def as_gpt2(model: Any) -> GPT2:
    """``model`` itself if it is the one GPT-2, else :func:`from_hf` of it (a copy)."""
    return model if isinstance(model, GPT2) else from_hf(model)
