"""Plain checkpoints of the one training entry: ZeRO's shards to the dense model's state and back.

A plain checkpoint is ``(model state, AdamW state, first step)`` by the dense model's names
(Hugging Face's, ``transformer.h.0.attn.c_attn.weight``), with AdamW's state indexed in the order
of the dense model's trainable parameters: what one process training with ``torch.optim.AdamW``
(:func:`~parallel_lib.training.reference`) saves and loads.

A rank's stage names its parameters without ``transformer.`` and holds the blocks' linear weights
as ``(out, in)``, where Hugging Face's ``Conv1D`` holds ``(in, out)``: :func:`to_stage` and
:func:`to_dense` rename and transpose the values and AdamW's moments alike (its update is
element-wise). ZeRO's own shard files (:func:`~parallel_lib.sharding.shard_state`) are in the
stage's names; :func:`~parallel_lib.sharding.consolidate` joins them and :func:`to_dense` makes
the result plain. Only a whole model (tp = pp = 1) has a plain checkpoint here.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional, Sequence

import torch

from parallel_lib.sharding.checkpoint import load_full
from parallel_lib.sharding.zero import ZeroEngine

__all__ = ["Checkpoint", "to_stage", "to_dense", "load_checkpoint"]

Checkpoint = tuple[dict[str, torch.Tensor], dict[str, Any], int]  # (model state, AdamW state, first step)

_LINEAR = re.compile(r"(^|\.)h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$")
_PREFIX = "transformer."


def _layout(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A block's linear weight (or its moment) transposed between (out, in) and (in, out); anything else as it is."""
    return tensor.t().contiguous() if _LINEAR.search(name) and tensor.dim() == 2 else tensor


def _convert(model_state: dict[str, torch.Tensor], optim_state: dict[str, Any], order: Sequence[str],
             new_order: Sequence[str], rename: Callable[[str], str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Rename and re-lay out a model state and an AdamW state indexed by ``order`` into ``new_order``."""
    position = {name: i for i, name in enumerate(new_order)}
    missing = [rename(n) for n in order if rename(n) not in position]
    if missing or len(order) != len(new_order):
        raise ValueError(f"the checkpoint's trainable parameters {list(order)[:3]}... do not match this model's "
                         f"{list(new_order)[:3]}... (missing {missing[:3]}); were they saved with other freeze= names?")
    state = {rename(n): _layout(n, v) for n, v in model_state.items() if n in set(order)}
    moments = {}
    for i, name in enumerate(order):
        if i in optim_state["state"]:
            moments[position[rename(name)]] = {k: _layout(name, v) if isinstance(v, torch.Tensor) else v
                                               for k, v in optim_state["state"][i].items()}
    groups = [dict(g, params=list(range(len(new_order)))) for g in optim_state["param_groups"]]
    return state, dict(state=moments, param_groups=groups)


def to_stage(model_state: dict[str, torch.Tensor], optim_state: dict[str, Any], dense_order: Sequence[str],
             stage_order: Sequence[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A plain checkpoint's states in a whole-model stage's names and layout (what ``load_full`` takes).

    Args:
        model_state, optim_state: by the dense names; AdamW's state indexed by ``dense_order``.
        dense_order, stage_order: the trainable parameters' names, the dense model's and the stage's.

    Raises:
        ValueError: the two orders name different parameters.
    """
    return _convert(model_state, optim_state, dense_order, stage_order, lambda n: n.removeprefix(_PREFIX))


def to_dense(model_state: dict[str, torch.Tensor], optim_state: dict[str, Any], stage_order: Sequence[str],
             dense_order: Sequence[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """:func:`to_stage` backwards: ``consolidate``'s states (the stage's names) as a plain checkpoint's.

    Raises:
        ValueError: the two orders name different parameters.
    """
    return _convert(model_state, optim_state, stage_order, dense_order, lambda n: _PREFIX + n)


def load_checkpoint(axis: Any, resume: Optional[Checkpoint], run: Any) -> int:
    """Load a plain checkpoint into this rank's ZeRO engine; returns the first step to train (0: none given).

    Call it on every rank of the dp axis (ZeRO-1/2 all-gather what they loaded).

    Raises:
        ValueError: a sync other than "zero", a pipeline or tensor split, a first step outside the
            run, or a measure_step before it.
    """
    if resume is None:
        return 0
    model_state, optim_state, first = resume
    stage = axis.model if isinstance(axis, ZeroEngine) else None
    if stage is None or stage.model.tp_info.tp > 1 or not (stage.first and stage.last):
        raise ValueError("resume loads a plain checkpoint into ZeRO's engine of the whole model: it needs "
                         "sync='zero', tp=1 and pp=1")
    if not 0 <= first < run.steps:
        raise ValueError(f"resume's first step must be in [0, steps={run.steps}), got {first}")
    if run.measure_step % run.steps < first:
        raise ValueError(f"measure_step={run.measure_step} is before the resumed run's first step {first}: "
                         "measure a step that runs")
    dense_order = [n for n, p in axis.model.model.named_parameters() if p.requires_grad]
    stage_order = [n for n, p in axis.model.named_parameters() if p.requires_grad]
    load_full(axis, *to_stage(model_state, optim_state, dense_order, stage_order))
    return first
