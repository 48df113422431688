"""Load imbalance, measured on the ranks: tokens per expert and per rank, and each rank's step time, step by step.

Expert parallelism's straggler: every all-to-all waits for the slowest rank, and a rank is slow
when its experts got more tokens than the others'. :func:`log_routing` trains the one GPT-2 with
its experts spread over ``ep`` and records, every step and layer, what each rank routed (kept
choices per expert), what its experts computed (rows received), and how long its step took, so
a notebook can plot tokens per expert and per rank over training, with and without the
balancing loss, and the busiest rank's time against the mean.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from parallel_lib.common.checks import check_number, positive_int
from parallel_lib.expert_parallel.expert_parallel_moe import ExpertParallelMoE, sync_ep_grads
from parallel_lib.expert_parallel.moe import MoEConfig, aux_loss_of
from parallel_lib.expert_parallel.parallelize import moe_gpt2, parallelize_ep
from parallel_lib.models.gpt2 import build_model
from parallel_lib.runtime.mesh import Mesh

__all__ = ["log_routing"]


def log_routing(rank: int, world_size: int, fields: dict, aux_coef: float = 0.01, steps: int = 5, rows: int = 2,
                seq: int = 16, vocab: int = 64, lr: float = 1e-3, seed: int = 0) -> dict[str, Any]:
    """A ``launch`` worker: ``steps`` AdamW steps of the expert-parallel tiny GPT-2 on random tokens, logged.

    Args:
        fields: :class:`~.moe.MoEConfig` fields.
        aux_coef: the balancing loss's weight ``α`` (0: none).
        steps, rows, seq: steps, and this rank's rows and sequence length per step.

    Returns:
        ``routed``: [step][layer][expert] kept choices of this rank's tokens; ``received``: [step][layer]
        rows this rank's experts computed; ``step_s``: [step] seconds of this rank's step; ``losses``.

    Raises:
        ValueError: a count below 1 or a negative ``aux_coef``.
    """
    config = MoEConfig(**fields)
    for name, value in (("steps", steps), ("rows", rows), ("seq", seq), ("vocab", vocab)):
        positive_int(name, value)
    check_number("aux_coef", aux_coef, 0.0)
    log: dict[str, Any] = dict(routed=[], received=[], step_s=[], losses=[])
    with Mesh(ep=world_size).build(timeout=60.0) as pm:
        model = parallelize_ep(moe_gpt2(build_model("tiny", vocab, seed=seed), config, seed=seed + 1), pm)
        layers = [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        data = torch.Generator().manual_seed(seed * 1000 + rank)  # each rank its own rows
        for _ in range(steps):
            ids = torch.randint(0, vocab, (rows, seq + 1), generator=data)
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            logits = model(ids[:, :-1])
            loss = model.loss(logits, ids[:, 1:]) + aux_coef * aux_loss_of(model)
            loss.backward()
            sync_ep_grads(model, pm.group("ep"))
            optimizer.step()
            log["step_s"].append(time.perf_counter() - start)
            log["routed"].append([m.last.tokens_per_expert.tolist() for m in layers])
            log["received"].append([m.received for m in layers])
            log["losses"].append(float(loss.detach()))
    return log
