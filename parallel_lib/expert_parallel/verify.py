"""Exactness checks that run inside ranks: expert parallelism against the one-process mixture layer.

Each function is a ``launch`` worker (``fn(rank, world_size, ...)``) that returns what it
measured (largest differences, counts, counted collectives), so a test asserts them and a
notebook prints them. Every rank builds the one-process layer from the same seed, runs it on
the whole batch (every rank's tokens, ``token_groups = ep``), and compares its own share.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from parallel_lib.common.compare import max_abs_difference
from parallel_lib.expert_parallel.balance import tokens_per_expert
from parallel_lib.expert_parallel.expert_parallel_moe import ExpertParallelMoE, sync_ep_grads
from parallel_lib.expert_parallel.moe import MoE, MoEConfig
from parallel_lib.expert_parallel.traffic import rows_leaving
from parallel_lib.runtime.collectives import count_collectives
from parallel_lib.runtime.mesh import Mesh

__all__ = ["ep_matches_one_process", "ep_traffic_counted", "balanced_router", "ep_refusals", "ep_checks"]

HIDDEN, INNER = 16, 32


def _layers(config: MoEConfig, ep: int, group: Any, seed: int) -> tuple[MoE, ExpertParallelMoE]:
    reference = MoE(HIDDEN, INNER, config, token_groups=ep, seed=seed)
    return reference, ExpertParallelMoE(MoE(HIDDEN, INNER, config, seed=seed), group)


def _grad_differences(reference: MoE, layer: ExpertParallelMoE) -> dict[str, float]:
    """Largest gradient difference of every parameter this rank holds, by the one-process layer's name."""
    ref = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in reference.named_parameters()}
    out = {}
    for name, p in layer.named_parameters():
        if name.startswith("experts."):
            i, rest = name.split(".", 2)[1:]
            name = f"experts.{layer.first_expert + int(i)}.{rest}"
        out[name] = max_abs_difference(p.grad, ref[name])
    return out


def _state_difference(reference: MoE, layer: ExpertParallelMoE) -> float:
    ref = dict(reference.named_parameters())
    worst = 0.0
    for name, p in layer.named_parameters():
        if name.startswith("experts."):
            i, rest = name.split(".", 2)[1:]
            name = f"experts.{layer.first_expert + int(i)}.{rest}"
        worst = max(worst, max_abs_difference(p.detach(), ref[name].detach()))
    return worst


def ep_matches_one_process(rank: int, world_size: int, cases: list[dict], steps: int = 3, tokens: int = 16,
                           aux_coef: float = 0.1, seed: int = 0) -> list[dict[str, Any]]:
    """Each case's expert-parallel layer over all ranks against the one-process layer.

    Each rank holds ``tokens`` tokens; the loss of rank ``r`` is ``(y_r · u_r).sum() + aux_coef · aux_r``
    and the reference's the mean of those over ranks (what :func:`sync_ep_grads` averages to).

    Args:
        cases: :class:`~.moe.MoEConfig` fields per case.
        steps: AdamW steps after the first forward and backward.

    Returns:
        Per case: largest differences of ``output``, ``input_grad``, ``aux_loss``, every parameter's
        gradient (``grads``: name -> difference) and of the parameters after ``steps`` AdamW steps
        (``after_steps``); ``dropped`` (choices dropped on this rank); ``counts`` (kept choices per
        expert on this rank, and in the reference's group).
    """
    results = []
    with Mesh(ep=world_size).build(timeout=60.0) as pm:
        group = pm.group("ep")
        for n, fields in enumerate(cases):
            config = MoEConfig(**fields)
            reference, layer = _layers(config, world_size, group, seed + n)
            data = torch.Generator().manual_seed(100 + n)
            x = torch.randn(world_size * tokens, HIDDEN, generator=data)
            u = torch.randn(world_size * tokens, HIDDEN, generator=data)
            mine = slice(rank * tokens, (rank + 1) * tokens)
            x_ref, x_mine = x.clone().requires_grad_(True), x[mine].clone().requires_grad_(True)
            y_ref = reference(x_ref)
            ((y_ref * u).sum() / world_size + aux_coef * reference.aux_loss).backward()
            y = layer(x_mine)
            ((y * u[mine]).sum() + aux_coef * layer.aux_loss).backward()
            sync_ep_grads(layer, group)
            record, ref_record = layer.last, reference.last
            result = dict(output=max_abs_difference(y, y_ref[mine]),
                          input_grad=max_abs_difference(x_mine.grad / world_size, x_ref.grad[mine]),
                          aux_loss=float(reference.aux_loss.detach()),  # the mean of the groups' losses
                          my_aux_loss=float(layer.aux_loss.detach()),
                          grads=_grad_differences(reference, layer), dropped=record.dropped,
                          counts=record.tokens_per_expert.tolist(),
                          reference_counts=tokens_per_expert(ref_record.experts[mine], config.n_experts,
                                                             ref_record.kept[mine]).tolist())
            ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
            opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
            ref_opt.step(), opt.step()
            for _ in range(steps - 1):
                x = torch.randn(world_size * tokens, HIDDEN, generator=data)
                for o in (ref_opt, opt):
                    o.zero_grad(set_to_none=True)
                y_ref = reference(x)
                ((y_ref * u).sum() / world_size + aux_coef * reference.aux_loss).backward()
                y = layer(x[mine])
                ((y * u[mine]).sum() + aux_coef * layer.aux_loss).backward()
                sync_ep_grads(layer, group)
                for p in reference.parameters():  # as sync_ep_grads does: an unreached expert steps on zeros
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                ref_opt.step(), opt.step()
            result["after_steps"] = _state_difference(reference, layer)
            results.append(result)
    return results


def balanced_router(layer: nn.Module, n_experts: int) -> None:
    """Set a router so that a token ``e_i`` (the i-th unit vector) chooses experts ``i, i+1, ..`` (mod E) in turn."""
    with torch.no_grad():
        gate = torch.zeros(n_experts, HIDDEN)
        for i in range(n_experts):
            for j in range(n_experts):
                gate[(i + j) % n_experts, i] = 10.0 - j  # expert i+j scores 10-j for token e_i
        layer.router.gate.weight.copy_(gate)


def ep_traffic_counted(rank: int, world_size: int, n_experts: int = 4, top_k: int = 2, tokens: int = 16,
                       capacity_factor: Any = None) -> dict[str, Any]:
    """One forward and backward of the expert-parallel layer, its all-to-alls counted.

    With ``capacity_factor`` None the router is :func:`balanced_router`'s (every rank sends each
    rank the same rows); else random, with drops.

    Returns:
        ``calls``: [(message bytes, wire bytes)] of each all-to-all in order, ``forward_calls``,
        ``kept`` (kept choices on this rank), ``leaving`` (of them, rows for other ranks).
    """
    config = MoEConfig(n_experts=n_experts, top_k=top_k, capacity_factor=capacity_factor)
    with Mesh(ep=world_size).build(timeout=60.0) as pm:
        layer = ExpertParallelMoE(MoE(HIDDEN, INNER, config, seed=7), pm.group("ep"))
        if capacity_factor is None:
            balanced_router(layer, n_experts)
            x = torch.zeros(tokens, HIDDEN)
            x[torch.arange(tokens), (torch.arange(tokens) + rank) % n_experts] = 1.0
        else:
            x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(rank))
        x.requires_grad_(True)
        with count_collectives() as counter:
            y = layer(x)
            forward_calls = counter.calls_of("all_to_all")
            y.sum().backward()
        record = layer.last
        return dict(calls=[(c.nbytes, c.wire_bytes) for c in counter.calls if c.kind == "all_to_all"],
                    forward_calls=forward_calls, kept=int(record.kept.sum()),
                    leaving=rows_leaving(record.experts, record.kept, n_experts, world_size, layer.ep_rank),
                    other_kinds=sorted({c.kind for c in counter.calls} - {"all_to_all"}))


def ep_refusals(rank: int, world_size: int) -> dict[str, str]:
    """What the expert-parallel layer says to bad input and to a peer that never comes (``"Kind: message"``).

    ``wrong_split``: 3 experts over the ``ep`` ranks; ``timeout``: rank 0 waits 1 s for an all-to-all
    of counts that the other ranks never join (they sleep 3 s, then leave).
    """
    out = {}
    with Mesh(ep=world_size).build(timeout=60.0) as pm:
        group = pm.group("ep")
        try:
            ExpertParallelMoE(MoE(HIDDEN, INNER, MoEConfig(n_experts=2 * world_size - 1)), group)
        except ValueError as error:
            out["wrong_split"] = f"ValueError: {error}"
        if rank == 0:
            from parallel_lib.expert_parallel.uneven_all_to_all import exchange_counts
            try:
                exchange_counts(torch.zeros(world_size, dtype=torch.int64), group, timeout=1.0)
            except TimeoutError as error:
                out["timeout"] = f"TimeoutError: {error}"
        else:
            time.sleep(3.0)  # present, but never joining: rank 0 times out before this rank leaves
    return out


def ep_checks(rank: int, world_size: int, cases: list[dict], steps: int = 3) -> dict[str, Any]:
    """Every check of one launch: :func:`ep_matches_one_process`, :func:`ep_traffic_counted` balanced and with
    drops, and :func:`ep_refusals` last (its timed-out exchange leaves the group unusable)."""
    return dict(cases=ep_matches_one_process(rank, world_size, cases, steps),
                traffic=ep_traffic_counted(rank, world_size, n_experts=2 * world_size),
                traffic_dropped=ep_traffic_counted(rank, world_size, n_experts=2 * world_size, capacity_factor=1.0),
                refusals=ep_refusals(rank, world_size))
