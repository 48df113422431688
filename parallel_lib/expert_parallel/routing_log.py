"""Load imbalance, measured on the ranks: tokens per expert and per rank, and each rank's step time, step by step.

Expert parallelism's straggler: every all-to-all waits for the slowest rank, and a rank is slow
when its experts got more tokens than the others'. :func:`log_routing` trains the one GPT-2 with
its experts spread over ``ep`` and records, every step and layer, what each rank routed (kept
choices per expert), what its experts computed (rows received) and how long they took, how long
its step took, and (``count=True``) the bytes its all-to-alls moved, so a notebook can plot tokens
per expert and per rank over training, with and without the balancing loss, and the busiest
rank's time against the mean. :func:`load_by_step` reads the ranks' logs together.

Left without the balancing loss, a router collapses: the experts that win early get the
tokens, learn, and win more (measured in ``tests/test_expert_parallel_ranks.py``: on the tiny
GPT-2, top-1 of 4 experts, the busiest expert's share grows step by step; with ``α = 0.1`` it
stays near the mean). Text makes it worse: words are Zipf-distributed, so the same few tokens
(and hidden states) come back again and again (``zipf``).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Sequence

import torch

from parallel_lib.common.checks import check_number, positive_int
from parallel_lib.expert_parallel.balance import imbalance
from parallel_lib.expert_parallel.expert_parallel_moe import ExpertParallelMoE, sync_ep_grads
from parallel_lib.expert_parallel.moe import MoEConfig, aux_loss_of
from parallel_lib.expert_parallel.parallelize import moe_gpt2, parallelize_ep
from parallel_lib.models.gpt2 import build_model
from parallel_lib.runtime.collectives import count_collectives
from parallel_lib.runtime.device import rank_device
from parallel_lib.runtime.mesh import Mesh

__all__ = ["log_routing", "load_by_step"]


def _tokens(rows: int, seq: int, vocab: int, zipf: float, generator: torch.Generator) -> torch.Tensor:
    if zipf == 0:
        return torch.randint(0, vocab, (rows, seq + 1), generator=generator)
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** zipf
    return torch.multinomial(weights, rows * (seq + 1), replacement=True, generator=generator).view(rows, seq + 1)


def log_routing(rank: int, world_size: int, fields: dict, aux_coef: float = 0.01, steps: int = 5, rows: int = 2,
                seq: int = 16, vocab: int = 64, lr: float = 1e-3, seed: int = 0, zipf: float = 0.0,
                count: bool = False, expert_compute: str = "loop") -> dict[str, Any]:
    """A ``launch`` worker: ``steps`` AdamW steps of the expert-parallel tiny GPT-2 on random tokens, logged.

    The model lives on the rank's device (its GPU under NCCL, where each step's time waits for its
    kernels; the expert seconds then count the experts' kernel launches, not their run).

    Args:
        fields: :class:`~.moe.MoEConfig` fields.
        aux_coef: the balancing loss's weight ``α`` (0: none).
        steps, rows, seq: steps, and this rank's rows and sequence length per step.
        zipf: tokens drawn with probability ``∝ 1 / r^zipf`` (``r`` the token's rank), as words in text
            (about 1); 0 draws them uniformly.
        count: count each step's all-to-alls (:func:`~parallel_lib.runtime.collectives.count_collectives`).
        expert_compute: "loop" or "grouped" (:mod:`.expert_compute`).

    Returns:
        ``routed``: [step][layer][expert] kept choices of this rank's tokens; ``received``: [step][layer]
        rows this rank's experts computed; ``expert_s``: [step][layer] seconds they took (forward);
        ``step_s``: [step] seconds of this rank's step; ``losses``; with ``count``, ``all_to_all``: [step]
        (calls, message bytes, wire bytes) of the step's all-to-alls.

    Raises:
        ValueError: a count below 1 or a negative ``aux_coef`` or ``zipf``.
    """
    config = MoEConfig(**fields)
    for name, value in (("steps", steps), ("rows", rows), ("seq", seq), ("vocab", vocab)):
        positive_int(name, value)
    check_number("aux_coef", aux_coef, 0.0)
    check_number("zipf", zipf, 0.0, hint="0 draws tokens uniformly; about 1 as words in text")
    log: dict[str, Any] = dict(routed=[], received=[], expert_s=[], step_s=[], losses=[])
    if count:
        log["all_to_all"] = []
    with Mesh(ep=world_size).build(timeout=60.0) as pm:
        model = parallelize_ep(moe_gpt2(build_model("tiny", vocab, seed=seed), config, seed=seed + 1), pm)
        device = rank_device()
        model.to(device)
        layers = [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]
        for layer in layers:
            layer.expert_compute = expert_compute
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        data = torch.Generator().manual_seed(seed * 1000 + rank)  # each rank its own rows
        for _ in range(steps):
            ids = _tokens(rows, seq, vocab, zipf, data).to(device)
            with count_collectives() if count else contextlib.nullcontext() as counter:
                start = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                logits = model(ids[:, :-1])
                loss = model.loss(logits, ids[:, 1:]) + aux_coef * aux_loss_of(model)
                loss.backward()
                sync_ep_grads(model, pm.group("ep"))
                optimizer.step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                log["step_s"].append(time.perf_counter() - start)
            if count:
                log["all_to_all"].append((counter.calls_of("all_to_all"), counter.nbytes("all_to_all"),
                                          counter.wire_bytes("all_to_all")))
            log["routed"].append([m.last.tokens_per_expert.tolist() for m in layers])
            log["received"].append([m.received for m in layers])
            log["expert_s"].append([m.compute_s for m in layers])
            log["losses"].append(float(loss.detach()))
    return log


def load_by_step(logs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rank's :func:`log_routing` log read together, one entry per step.

    Args:
        logs: the ranks' logs, in rank order.

    Returns:
        Per step: ``per_expert`` (E,) kept choices over every rank and layer; ``per_rank`` (ep,) rows each
        rank's experts computed over the layers; ``expert_imbalance``: the busiest expert over the mean,
        averaged over the layers; ``rank_imbalance``: the same of the ranks; ``busiest_expert_s`` and
        ``mean_expert_s``: seconds the busiest rank's experts computed (the rank with the most rows) and
        the mean over ranks; ``step_s``: the slowest rank's step (what every all-to-all waited for) and
        ``mean_step_s`` the mean over ranks (close to it: a rank that finishes early waits in the next all-to-all).

    Raises:
        ValueError: no logs, or logs of different lengths.
    """
    if not logs or len({len(log["routed"]) for log in logs}) != 1:
        raise ValueError(f"logs must be every rank's log_routing of the same run, got {len(logs)} log(s) of lengths "
                         f"{[len(log['routed']) for log in logs]}")
    out = []
    for step in range(len(logs[0]["routed"])):
        routed = torch.tensor([log["routed"][step] for log in logs])     # (ep, layers, E)
        received = torch.tensor([log["received"][step] for log in logs])  # (ep, layers)
        by_layer = routed.sum(0)                                         # (layers, E)
        expert_s = [sum(log["expert_s"][step]) for log in logs] if "expert_s" in logs[0] else [0.0] * len(logs)
        busiest = int(received.sum(1).argmax())
        out.append(dict(per_expert=by_layer.sum(0).tolist(), per_rank=received.sum(1).tolist(),
                        expert_imbalance=sum(imbalance(c) for c in by_layer) / len(by_layer),
                        rank_imbalance=sum(imbalance(c) for c in received.t()) / received.shape[1],
                        busiest_expert_s=expert_s[busiest], mean_expert_s=sum(expert_s) / len(expert_s),
                        step_s=max(log["step_s"][step] for log in logs),
                        mean_step_s=sum(log["step_s"][step] for log in logs) / len(logs)))
    return out
