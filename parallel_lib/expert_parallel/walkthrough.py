"""Chapter 12's run on ranks, in one launch: the proof, one dispatch's record, the bytes counted, the imbalance logged.

A notebook pays for every launch (fresh interpreters, the process group), so the chapter
starts its ranks once and this worker returns everything the chapter shows from them:

- ``proof``: :func:`~.verify.ep_matches_one_process` on :data:`PROOF_CASES` (outputs, every
  gradient and the parameters after AdamW steps against the one-process layer);
- ``dispatch``: one forward of a small expert-parallel layer, its :class:`~.moe.RoutingRecord`
  (the widget replays it), the counts the ranks exchanged and the rows each rank's experts got;
- ``traffic``: :func:`~.verify.ep_traffic_counted`, the all-to-alls counted against the formula;
- ``logs``: :func:`~.routing_log.log_routing` of the same training without and with the balancing
  loss (:data:`IMBALANCE_ALPHAS`).
"""

from __future__ import annotations

from typing import Any

import torch

from parallel_lib.expert_parallel.dispatch_plan import dispatch_plan
from parallel_lib.expert_parallel.expert_parallel_moe import ExpertParallelMoE
from parallel_lib.expert_parallel.moe import MoE, MoEConfig
from parallel_lib.expert_parallel.routing_log import log_routing
from parallel_lib.expert_parallel.uneven_all_to_all import exchange_counts
from parallel_lib.expert_parallel.verify import HIDDEN, INNER, ep_matches_one_process, ep_traffic_counted
from parallel_lib.runtime.mesh import Mesh

__all__ = ["PROOF_CASES", "DISPATCH_FIELDS", "DISPATCH_TOKENS", "IMBALANCE_FIELDS", "IMBALANCE_ALPHAS",
           "IMBALANCE_RUN", "one_dispatch", "ep_walkthrough"]

PROOF_CASES = [dict(n_experts=4, top_k=1),                                            # Switch: nothing dropped
               dict(n_experts=4, top_k=2, capacity_factor=1.0, shared_expert=True)]   # drops; a shared expert
DISPATCH_FIELDS = dict(n_experts=4, top_k=2, capacity_factor=1.0)  # the widget's layer: some choices dropped
DISPATCH_TOKENS = 8                                                # per rank
IMBALANCE_FIELDS = dict(n_experts=4, top_k=1)                      # no capacity: every choice is computed
IMBALANCE_ALPHAS = (0.0, 0.1)
IMBALANCE_RUN = dict(steps=12, rows=4, seq=16, lr=3e-3)           # log_routing's arguments


def one_dispatch(rank: int, world_size: int, seed: int = 3) -> dict[str, Any]:
    """A ``launch`` worker: one forward of a small expert-parallel layer (:data:`DISPATCH_FIELDS`), its routing
    record, the counts the ranks exchanged and the rows this rank's experts received (the widget replays it)."""
    config = MoEConfig(**DISPATCH_FIELDS)
    with Mesh(ep=world_size).build(timeout=60.0) as pm:
        group = pm.group("ep")
        layer = ExpertParallelMoE(MoE(HIDDEN, INNER, config, seed=seed), group)
        x = torch.randn(DISPATCH_TOKENS, HIDDEN, generator=torch.Generator().manual_seed(40 + rank))
        with torch.no_grad():
            layer(x)
        record = layer.last
        plan = dispatch_plan(record.experts, record.kept, config.n_experts, world_size)
        incoming = exchange_counts(plan.counts, group)  # the layer's own exchange, once more: (ep, E/ep)
        return dict(experts=record.experts, kept=record.kept, weights=record.weights.detach(),
                    capacity=record.capacity, incoming=incoming, received=layer.received, send=plan.send)


def ep_walkthrough(rank: int, world_size: int, proof_steps: int = 3) -> dict[str, Any]:
    """A ``launch`` worker: every measurement chapter 12 shows from its ranks (see the module docstring).

    Returns:
        ``proof`` (per case of :data:`PROOF_CASES`), ``dispatch``, ``traffic`` and ``logs`` (α -> log).
    """
    return dict(proof=ep_matches_one_process(rank, world_size, PROOF_CASES, proof_steps),
                dispatch=one_dispatch(rank, world_size),
                traffic=ep_traffic_counted(rank, world_size, n_experts=2 * world_size),
                logs={alpha: log_routing(rank, world_size, IMBALANCE_FIELDS, alpha, **IMBALANCE_RUN)
                      for alpha in IMBALANCE_ALPHAS})
