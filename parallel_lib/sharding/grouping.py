"""Which parameters share a flat buffer: the unit every ZeRO collective moves.

Stages 0-2 reduce gradients as soon as backward has produced a bucket of them, so their groups
are *buckets* of about ``bucket_cap_mb`` taken in reverse parameter order (roughly the order
backward produces gradients, as PyTorch's DDP buckets them). Stage 3 gathers parameters just
before a layer computes, so its groups are *layers* (GPT-2's blocks), plus one "outer" group
for what lies outside them (embeddings, final norm, the tied head). In both, a parameter named
in ``separate`` gets a group of its own, so that this rank's shard of its gradient covers the
same elements on every model that holds a copy (a pipeline's tied embedding, summed shard by
shard between its first and last stage).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

from torch import nn

from parallel_lib.data_parallel.buckets import make_buckets
from parallel_lib.sharding.layers import layer_modules

__all__ = ["FlatGroups", "flat_groups"]


class FlatGroups(NamedTuple):
    """The parameter lists of the flat groups, their names, and each group's module (stage 3; None: the root)."""

    params: list[list[nn.Parameter]]
    names: list[str]
    owners: list[Optional[nn.Module]]


def flat_groups(model: nn.Module, stage: int, separate: Sequence[nn.Parameter], bucket_cap_bytes: int,
                layer_groups: Optional[Sequence[nn.Module]] = None) -> FlatGroups:
    """The flat groups of ``model``'s trainable parameters for a ZeRO ``stage`` (see the module docstring).

    ``separate`` must hold trainable parameters of the model (the caller checks). Parameters are
    named by their attribute ``_zero_name`` when set (the engine sets it), else by position.
    """
    def name(p: nn.Parameter) -> str:
        return getattr(p, "_zero_name", "separate")

    alone = [p for p in separate if p.requires_grad]
    apart = {id(p) for p in alone}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in apart]
    if stage < 3:  # reverse order: roughly the order in which backward produces the gradients
        buckets = make_buckets(rest[::-1], bucket_cap_bytes)
        return FlatGroups([[p] for p in alone] + buckets, [name(p) for p in alone]
                          + [f"bucket {i}" for i in range(len(buckets))], [None] * (len(alone) + len(buckets)))
    layers = list(layer_groups) if layer_groups is not None else layer_modules(model)
    in_layers = [[p for p in layer.parameters() if p.requires_grad and id(p) not in apart] for layer in layers]
    seen = {id(p) for ps in in_layers for p in ps}
    outer = [p for p in rest if id(p) not in seen]
    kept = [(i, layer, ps) for i, (layer, ps) in enumerate(zip(layers, in_layers)) if ps]
    return FlatGroups([[p] for p in alone] + ([outer] if outer else []) + [ps for _, _, ps in kept],
                      [name(p) for p in alone] + (["outer"] if outer else []) + [f"layer {i}" for i, _, _ in kept],
                      [None] * (len(alone) + bool(outer)) + [layer for _, layer, _ in kept])
