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

import difflib
import inspect
from functools import lru_cache
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from parallel_lib.common.checks import check_choice, positive_int

__all__ = ["GPT2_SIZES", "gpt2_config", "build_gpt2", "PositionEmbedding", "count_parameters"]

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
        ValueError: unknown ``name``, a ``vocab_size`` below 1, or an override that is not a
            ``GPT2Config`` field (``n_layers`` for ``n_layer``: ``GPT2Config`` would keep it as
            an unused attribute and build the default depth without a word).
    """
    check_choice("name", name, sorted(GPT2_SIZES))
    positive_int("vocab_size", vocab_size)
    unknown = sorted(set(overrides) - _config_fields())
    if unknown:
        guesses = {key: difflib.get_close_matches(key, sorted(_config_fields()), n=1) for key in unknown}
        meant = "; ".join(f"{key}: did you mean {guess[0]}?" for key, guess in guesses.items() if guess)
        raise ValueError(f"unknown GPT2Config field(s) {unknown} in the overrides"
                         f"{' (' + meant + ')' if meant else ''}; the size fields are n_layer, n_embd, n_head, "
                         "n_positions")
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
    # on the position table itself, so that pipeline stages built from its layers check too
    model.transformer.wpe.__class__ = PositionEmbedding
    return model


class PositionEmbedding(torch.nn.Embedding):
    """GPT-2's position table, which refuses a sequence longer than the model.

    Without the check, torch fails deep inside the embedding with "IndexError: index out
    of range in self", which names neither the sequence nor the model's limit. The table
    is the one module every forward pass (whole model or pipeline stage) goes through.
    """

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        length = positions.shape[-1]
        if length > self.num_embeddings:
            raise ValueError(f"a sequence of {length} tokens is longer than the model's n_positions="
                             f"{self.num_embeddings}; cut the batch (collate_batch(..., model_max_length="
                             f"{self.num_embeddings})) or build a model with more positions (n_positions=...)")
        return super().forward(positions)


@lru_cache(maxsize=1)
def _config_fields() -> frozenset[str]:
    """Every name ``GPT2Config`` accepts as a field (its own, the shared config ones, the aliases)."""
    own = set(inspect.signature(GPT2Config.__init__).parameters) - {"self", "kwargs"}
    return frozenset(own | set(GPT2Config().to_dict()) | set(GPT2Config.attribute_map))


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied weights, like GPT-2's head, count once)."""
    return sum(p.numel() for p in model.parameters())
