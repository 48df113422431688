"""GPT-2 models by size name, built from a config and a seed (never downloaded).

The course trains Hugging Face's ``GPT2LMHeadModel`` so that what readers split
across devices is the real architecture, but every weight is initialised from a
seed: the notebooks run offline and two processes that build the same name and
seed hold bit-identical models, which the equivalence checks rely on.

Dropout defaults to 0 in every size. Parallel and single-device runs can then be
compared exactly (each rank or pipeline stage would otherwise draw different
dropout masks), and modern pre-training recipes (nanoGPT, LLaMA) use none either.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from parallel_lib.common.checks import check_choice, positive_int

__all__ = ["GPT2_SIZES", "gpt2_config", "build_gpt2", "count_parameters"]

# name -> the shape fields of GPT2Config. "gpt2" is the real 124M shape.
GPT2_SIZES: dict[str, dict[str, int]] = {
    # runs a training step in far under a second on a laptop CPU: tests, CPU notebooks
    "tiny": dict(n_embd=64, n_layer=4, n_head=4, n_positions=128),
    # large enough that compute dominates overheads on CPU: CPU benchmarks
    "small": dict(n_embd=256, n_layer=6, n_head=8, n_positions=256),
    # the shape of OpenAI's GPT-2 small (124M parameters with its 50,257-token vocabulary)
    "gpt2": dict(n_embd=768, n_layer=12, n_head=12, n_positions=1024),
}


def gpt2_config(name: str = "tiny", vocab_size: int = 50257, **overrides: Any) -> GPT2Config:
    """The ``GPT2Config`` of a named size.

    Args:
        name: one of ``GPT2_SIZES`` ("tiny", "small", "gpt2").
        vocab_size: size of the tokenizer's vocabulary.
        **overrides: any ``GPT2Config`` field, e.g. ``n_layer=8``.

    Raises:
        ValueError: unknown ``name`` or a ``vocab_size`` below 1.
    """
    check_choice("name", name, sorted(GPT2_SIZES))
    positive_int("vocab_size", vocab_size)
    fields: dict[str, Any] = dict(GPT2_SIZES[name])
    # bos/eos default to None: GPT-2's 50256 lies outside a course tokenizer's vocabulary;
    # pass the tokenizer's ids as overrides where generation needs them
    fields.update(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, vocab_size=vocab_size,
                  bos_token_id=None, eos_token_id=None)
    fields.update(overrides)
    return GPT2Config(**fields)


def build_gpt2(name: str = "tiny", vocab_size: int = 50257, seed: int = 0, **overrides: Any) -> GPT2LMHeadModel:
    """A freshly initialised ``GPT2LMHeadModel`` of a named size.

    The same ``(name, vocab_size, seed, overrides)`` gives bit-identical weights in
    any process, so ranks can each build their replica instead of receiving one.

    Args:
        name: one of ``GPT2_SIZES``.
        vocab_size: size of the tokenizer's vocabulary.
        seed: seed of the weight initialisation.
        **overrides: any ``GPT2Config`` field.
    """
    config = gpt2_config(name, vocab_size, **overrides)
    # fork_rng: building a model must not disturb the caller's random stream
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(config)
    return model


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied weights, like GPT-2's head, count once)."""
    return sum(p.numel() for p in model.parameters())
