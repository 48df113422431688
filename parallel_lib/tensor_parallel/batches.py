"""Chapter 07's run settings and its batches: :class:`TPConfig` and :func:`make_batches`.

A tensor-parallel (× data-parallel) run is a plan of the one training entry
(:func:`parallel_lib.training.train`, built from a :class:`TPConfig` by
:func:`parallel_lib.training.tp_layout`); the chapter's exactness checks
(:mod:`.verify`, :mod:`.dtensor`) build the same model and batches from the same config here.
Every process draws the same batches from the seed: right-padded synthetic rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from parallel_lib.common.checks import check_choice, check_int
from parallel_lib.common.models import GPT2_SIZES

__all__ = ["TPConfig", "make_batches"]


@dataclass(frozen=True)
class TPConfig:
    """One tensor-parallel training run (every field is a flag of ``python -m parallel_lib.tensor_parallel``)."""

    model: str = "tiny"            # a GPT2_SIZES name
    vocab_size: int = 128          # divisible by tp
    batch_size: int = 4            # sequences per data-parallel rank and step
    seq_len: int = 32              # divisible by tp under sequence parallelism
    steps: int = 3
    lr: float = 1e-3
    seed: int = 0
    tp: int = 0                    # tensor-parallel size; 0: all ranks (dp = world_size / tp)
    sequence_parallel: bool = False
    dropout: float = 0.0           # resid, attn and embd dropout of the model
    padding: bool = True           # right-pad some sequences (attention and loss masks)
    n_layer: int = 0               # 0: the size's own depth
    n_embd: int = 0                # 0: the size's own width (n_head stays; must divide)

    def check(self) -> None:
        """Refuse, naming the field, a model no rank could build (the run's other fields: ``RunConfig.check``).

        Raises:
            ValueError: an unknown model, ``tp``, ``n_layer`` or ``n_embd`` below 0 (or not an int), or a
                width the model's heads do not divide.
        """
        check_choice("model", self.model, sorted(GPT2_SIZES))
        check_int("tp", self.tp, 0, hint="0 puts every rank in one tensor-parallel group")
        for name in ("n_layer", "n_embd"):
            check_int(name, getattr(self, name), 0, hint="0 keeps the model size's own")
        n_embd, n_head = self.n_embd or GPT2_SIZES[self.model]["n_embd"], GPT2_SIZES[self.model]["n_head"]
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} is not divisible by the {self.model} model's n_head={n_head}; "
                             "choose a width that is a multiple of it")

    def overrides(self) -> dict[str, Any]:
        """``build_gpt2`` overrides for dropout and the optional depth and width."""
        extra: dict[str, Any] = dict(resid_pdrop=self.dropout, attn_pdrop=self.dropout, embd_pdrop=self.dropout)
        if self.n_layer:
            extra["n_layer"] = self.n_layer
        if self.n_embd:
            extra["n_embd"] = self.n_embd
        return extra


def make_batches(config: TPConfig, dp: int = 1) -> list[dict[str, torch.Tensor]]:
    """``config.steps`` global batches of ``batch_size · dp`` sequences (the same in every process)."""
    g = torch.Generator().manual_seed(config.seed + 1)
    batches, rows = [], config.batch_size * dp
    for _ in range(config.steps):
        ids = torch.randint(0, config.vocab_size, (rows, config.seq_len + 1), generator=g)
        mask = torch.ones(rows, config.seq_len, dtype=torch.long)
        if config.padding:  # every other sequence ends early: right padding
            lengths = torch.randint(config.seq_len // 2, config.seq_len + 1, (rows,), generator=g)
            mask = (torch.arange(config.seq_len)[None] < lengths[:, None]).long()
            mask[0] = 1  # at least one full row
        batches.append(dict(input_ids=ids[:, :-1], labels=ids[:, 1:], attention_mask=mask,
                            label_token_weights=mask.float()))
    return batches
