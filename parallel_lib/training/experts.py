"""The run's mixture of experts: the one GPT-2 with its MLPs swapped, and the ep axis's two gradient groups.

``RunConfig(experts=E, top_k=k, capacity_factor=c)`` asks for chapter 12's model: every block's
MLP becomes the one-process :class:`~parallel_lib.expert_parallel.MoE` that
:func:`~parallel_lib.expert_parallel.moe_gpt2` builds from the run's seed (``experts=0``: the
dense GPT-2). The one-process reference and every rank build it the same way
(:func:`mixture_of_experts`), so they start from the same weights:

- the reference swaps the MLPs of the dense model it trains, routing its tokens in the groups
  the ranks route them in (one group per replica and micro-batch: capacity and the balancing
  loss are per group; without a capacity limit the groups change nothing);
- a rank swaps the mixtures into its tensor-parallel shard (:func:`swap_mixtures`; tp = 1) and,
  with ``Plan.ep > 1``, spreads their experts over ``pm.group("ep")``
  (:func:`~parallel_lib.expert_parallel.parallelize_ep`).

The balancing loss is not added to the training loss (the layers record it, ``aux_loss_of``).

**Gradients under ep** (:class:`ExpertAxis`). The ep ranks each train on rows of their own, so
for every part of the model but the experts they are data-parallel: those gradients are averaged
over the flattened ``("dp", "ep")`` group by one :class:`~parallel_lib.sharding.ZeroEngine`. An
expert lives on one rank of each ep group, and its gradient already holds the sum over that
group's tokens (the all-to-all's backward brought them): it is divided by ``ep`` as it
accumulates and averaged over ``dp`` by a second engine. That is
:func:`~parallel_lib.expert_parallel.sync_ep_grads`'s arithmetic, with ZeRO over the replicas.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from parallel_lib.expert_parallel.expert_parallel_moe import ExpertParallelMoE, expert_parameters
from parallel_lib.expert_parallel.moe import MoEConfig
from parallel_lib.expert_parallel.parallelize import moe_gpt2
from parallel_lib.models.gpt2 import GPT2
from parallel_lib.models.hf import from_hf
from parallel_lib.runtime.mesh import RankMesh
from parallel_lib.sharding.memory import optimizer_tensors, storage_census
from parallel_lib.sharding.zero import ZeroEngine

__all__ = ["moe_config", "mixture_of_experts", "swap_mixtures", "dense_mlps", "mixture_state", "holds_mixtures",
           "ExpertAxis"]


def moe_config(run: Any) -> MoEConfig:
    """The mixture the run asks for (``run.experts`` > 0): experts, top-k and capacity factor (0: no limit)."""
    return MoEConfig(n_experts=run.experts, top_k=run.top_k, capacity_factor=run.capacity_factor or None)


def mixture_of_experts(model: Any, run: Any, token_groups: int = 1) -> GPT2:
    """The one GPT-2 of ``model`` (a Hugging Face GPT-2 is converted) with every MLP a mixture of the run's seed.

    Args:
        model: the dense model a builder made (``GPT2LMHeadModel`` or the one GPT-2).
        run: the :class:`~parallel_lib.training.run.RunConfig` (``experts``, ``top_k``, ``capacity_factor``, ``seed``).
        token_groups: the groups each forward's tokens are routed in.
    """
    dense = model if isinstance(model, GPT2) else from_hf(model, run.seed)
    return moe_gpt2(dense, moe_config(run), token_groups, seed=run.seed)


def swap_mixtures(shard: GPT2, mixtures: GPT2) -> None:
    """Put the mixtures of ``mixtures`` (:func:`mixture_of_experts`) into ``shard``'s blocks, in place.

    ``shard`` is the tensor-parallel shard (tp = 1) of the same dense model; its split MLPs are
    kept aside (``shard._dense_mlps``) for :func:`dense_mlps`.
    """
    shard._dense_mlps = [block.mlp for block in shard.transformer.h]  # type: ignore[assignment]
    for mine, theirs in zip(shard.transformer.h, mixtures.transformer.h):
        mine.mlp = theirs.mlp


@contextmanager
def dense_mlps(shard: GPT2) -> Iterator[None]:
    """Inside the block, ``shard``'s blocks hold their split dense MLPs again (``gather_dense`` reads them)."""
    if not holds_mixtures(shard):
        yield
        return
    kept, mixtures = shard._dense_mlps, [block.mlp for block in shard.transformer.h]
    try:
        for block, mlp in zip(shard.transformer.h, kept):
            block.mlp = mlp
        yield
    finally:
        for block, mlp in zip(shard.transformer.h, mixtures):
            block.mlp = mlp


def mixture_state(shard: GPT2) -> dict[str, torch.Tensor]:
    """The mixtures' parameters this rank holds, by the one-process model's names (experts by their global index)."""
    state = {}
    for block in shard.transformer.h:
        first = getattr(block.mlp, "first_expert", 0)  # an ExpertParallelMoE holds experts first, first + 1, ...
        for name, p in block.mlp.named_parameters():
            if name.startswith("experts."):
                _, index, rest = name.split(".", 2)
                name = f"experts.{int(index) + first}.{rest}"
            state[f"transformer.h.{block.layer}.mlp.{name}"] = p.detach().cpu().clone()
    return state


def holds_mixtures(shard: GPT2) -> bool:
    """Whether :func:`swap_mixtures` put mixtures into ``shard``."""
    return getattr(shard, "_dense_mlps", None) is not None


class ExpertAxis:
    """The dp axis of an ep run: one ZeroEngine for the replicated parameters, one for this rank's experts.

    The interface :func:`~parallel_lib.training.data_axis.data_parallel_axis` documents
    (``reduce_gradients``, ``step``, ``census``, ``remove``, ``master``); see the module docstring.

    Args:
        plan, run: the plan (``zero``, ``ep``) and run (AdamW's and ZeRO's settings).
        stage: this rank's stage, its mixtures already spread over ep.
        pm: the built mesh (with the flattened ``("dp", "ep")`` group).
    """

    def __init__(self, plan: Any, run: Any, stage: nn.Module, pm: RankMesh) -> None:
        experts = [p for p in expert_parameters(stage) if p.requires_grad]
        options = dict(lr=run.lr, eps=run.eps, weight_decay=run.weight_decay, precision=run.precision,
                       collectives=run.collectives, bucket_cap_mb=run.bucket_cap_mb)
        for p in experts:  # out of the replicated engine's flat groups
            p.requires_grad_(False)
        self.replicated = ZeroEngine(stage, plan.zero, group=pm.group(("dp", "ep")), **options)
        for p in experts:
            p.requires_grad_(True)
        holder = nn.ModuleList(m.experts for m in stage.modules() if isinstance(m, ExpertParallelMoE))
        self.experts = ZeroEngine(holder, plan.zero, group=pm.group("dp"), **options)
        ep = pm.size("ep")  # an expert's gradient is the sum over the ep group's tokens: its share is 1/ep
        self._hooks = [p.register_hook(lambda grad: grad / ep) for p in experts]
        self.engines = (self.replicated, self.experts)

    @property
    def master(self) -> list[torch.Tensor]:
        """What the two optimizers update on this rank."""
        return [t for engine in self.engines for t in engine.master]

    def reduce_gradients(self) -> None:
        for engine in self.engines:
            engine.reduce_gradients()

    def reduced_gradient(self, param: nn.Parameter) -> torch.Tensor:
        return self.replicated.reduced_gradient(param)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        raise ValueError("max_grad_norm with ep > 1 is not supported yet (two groups hold the gradient); set "
                         "max_grad_norm=0.0")

    def step(self) -> None:
        for engine in self.engines:
            engine.step()

    def census(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer states the two engines hold (each storage once)."""
        engines = self.engines
        params = [t for e in engines for t in [*e.model.parameters(), *(g.shard for g in e.groups)]]
        grads = [t for e in engines for t in [*(p.grad for p in e.model.parameters()), *getattr(e, "grad_full", []),
                                              *e.grad_shards]]
        optimizer = [t for e in engines for t in [*e.master, *optimizer_tensors(e.optimizer)]]
        return storage_census(params, grads, optimizer)

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for engine in self.engines:
            engine.remove()
