"""Mixture of experts in the one GPT-2: every block's MLP swapped for a mixture, then its experts spread over ``ep``.

Two steps, as every parallelism of the course applies to the one model:

1. :func:`moe_gpt2` turns the dense model into a mixture-of-experts model in one process:
   each block's ``mlp`` becomes a :class:`~.moe.MoE` of the same widths (keeping the MLP's
   dropout for its output). Nothing else changes: the block calls ``self.mlp(ln_2(x))`` as
   before, so attention, embeddings, the head and the loss are the dense model's.
2. :func:`parallelize_ep` keeps, on each rank of the mesh's ``ep`` axis, the router, the
   shared expert and ``E/ep`` experts of every layer (:class:`~.expert_parallel_moe.ExpertParallelMoE`).
   Every other part is replicated: the ``ep`` ranks are data-parallel for it, each with its own
   rows of the batch, and :func:`~.expert_parallel_moe.sync_ep_grads` averages its gradients.

The reference for a run on ``ep`` ranks is the same model built with ``token_groups=ep`` on the
ranks' rows concatenated (capacity and balancing loss per rank's tokens). Dropout masks are
not split over ``ep``; the proofs run without dropout, as every course size does by default.
"""

from __future__ import annotations

from typing import Any

from parallel_lib.common.checks import check_int, positive_int
from parallel_lib.expert_parallel.expert_parallel_moe import ExpertParallelMoE
from parallel_lib.expert_parallel.moe import MoE, MoEConfig
from parallel_lib.models.gpt2 import GPT2
from parallel_lib.models.mlp import MLP
from parallel_lib.runtime.mesh import RankMesh

__all__ = ["moe_gpt2", "parallelize_ep", "ep_group_of"]


def moe_gpt2(model: GPT2, config: MoEConfig, token_groups: int = 1, seed: int = 0) -> GPT2:
    """Swap every block's MLP of ``model`` for a :class:`~.moe.MoE` (in place); return ``model``.

    Layer ``i``'s mixture is initialised from ``seed + i`` (the same on every rank).

    Args:
        model: the one GPT-2 with dense MLPs.
        config: the mixture (experts, top-k, capacity, shared expert).
        token_groups: groups its tokens are routed in (``ep`` for the reference of an ``ep``-rank run).
        seed: the seed of the mixtures' weights.

    Raises:
        TypeError: ``model`` is not the one GPT-2, or ``config`` not a :class:`~.moe.MoEConfig`.
        ValueError: ``model``'s MLPs are already mixtures.
    """
    _check_model(model)
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
    positive_int("token_groups", token_groups)
    check_int("seed", seed)
    for block in model.transformer.h:
        if not isinstance(block.mlp, MLP):
            raise ValueError(f"block {block.layer}'s mlp is already a {type(block.mlp).__name__}: swap a dense model")
        hidden, inner = block.mlp.c_fc.weight.shape
        moe = MoE(hidden, inner, config, token_groups, seed + block.layer, dropout=block.mlp.dropout)
        block.mlp = moe.to(block.mlp.c_fc.weight.dtype)
    return model


def ep_group_of(mesh_or_group: Any) -> Any:
    """The expert-parallel process group: ``mesh.group("ep")`` of a ``RankMesh``, or the group itself."""
    return mesh_or_group.group("ep") if isinstance(mesh_or_group, RankMesh) else mesh_or_group


def parallelize_ep(model: GPT2, mesh: Any, timeout: float = 60.0) -> GPT2:
    """Spread the experts of every mixture layer of ``model`` over the ``ep`` axis (in place); return ``model``.

    Args:
        model: a mixture-of-experts GPT-2 (:func:`moe_gpt2`), built the same on every rank.
        mesh: a ``RankMesh`` (its ``ep`` group is used) or the expert-parallel process group.
        timeout: seconds each all-to-all may wait.

    Raises:
        TypeError: ``model`` is not the one GPT-2.
        ValueError: a block's MLP is not a one-process mixture (dense, or already spread).
    """
    _check_model(model)
    group = ep_group_of(mesh)
    for block in model.transformer.h:
        if not isinstance(block.mlp, MoE):
            raise ValueError(f"block {block.layer}'s mlp is a {type(block.mlp).__name__}, not a MoE: call "
                             "moe_gpt2(model, config) first, on a model not yet spread over ep")
        block.mlp = ExpertParallelMoE(block.mlp, group, timeout)
    return model


def _check_model(model: Any) -> None:
    if not isinstance(model, GPT2):
        raise TypeError(f"model must be the one GPT2 (parallel_lib.models.build_model), got {type(model).__name__}")
