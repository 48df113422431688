"""Exactness checks that run inside ranks: expert parallelism against the one-process mixture layer.

Each function is a ``launch`` worker (``fn(rank, world_size, ...)``) that returns what it
measured (largest differences, counts, counted collectives), so a test asserts them, a notebook
prints them and the chapter's GPU check runs them on NCCL ranks (the layer on the rank's GPU). Every rank builds the one-process layer from the same seed, runs it on
the whole batch (every rank's tokens, ``token_groups = ep``), and compares its own share.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch
from torch import nn

from parallel_lib.common.compare import max_abs_difference
from parallel_lib.expert_parallel.balance import tokens_per_expert
from parallel_lib.expert_parallel.expert_parallel_moe import ExpertParallelMoE, sync_ep_grads
from parallel_lib.expert_parallel.moe import MoE, MoEConfig, aux_loss_of
from parallel_lib.expert_parallel.parallelize import moe_gpt2, parallelize_ep
from parallel_lib.expert_parallel.routing_log import log_routing
from parallel_lib.expert_parallel.traffic import rows_leaving
from parallel_lib.expert_parallel.uneven_all_to_all import exchange_counts
from parallel_lib.models.gpt2 import build_model
from parallel_lib.runtime.collectives import count_collectives
from parallel_lib.runtime.device import rank_device
from parallel_lib.runtime.mesh import Mesh

__all__ = ["global_parameters", "ep_matches_one_process", "gpt2_ep_check", "balanced_router", "ep_traffic_counted",
           "ep_refusals", "ep_idle_rank", "ep_census", "ep_balance", "ep_checks", "BALANCE_RUN"]

HIDDEN, INNER = 16, 32


def _layers(fields: dict, ep: int, group: Any, seed: int) -> tuple[MoE, ExpertParallelMoE]:
    fields = dict(fields)
    how = fields.pop("expert_compute", "loop")
    config = MoEConfig(**fields)
    reference = MoE(HIDDEN, INNER, config, token_groups=ep, seed=seed)
    return reference, ExpertParallelMoE(MoE(HIDDEN, INNER, config, seed=seed), group, expert_compute=how)


def global_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """``model``'s parameters by their name in the one-process model: this rank's experts by their global index."""
    names = {}
    for prefix, m in model.named_modules():
        if isinstance(m, ExpertParallelMoE):
            for j, expert in enumerate(m.experts):
                for n, p in expert.named_parameters():
                    names[id(p)] = f"{prefix + '.' if prefix else ''}experts.{m.first_expert + j}.{n}"
    return {names.get(id(p), n): p for n, p in model.named_parameters()}


def _grad_differences(reference: nn.Module, model: nn.Module) -> dict[str, float]:
    """Largest gradient difference of every parameter this rank holds, by the one-process model's name."""
    ref = dict(reference.named_parameters())
    return {n: max_abs_difference(p.grad, ref[n].grad if ref[n].grad is not None else torch.zeros_like(p))
            for n, p in global_parameters(model).items()}


def _state_difference(reference: nn.Module, model: nn.Module) -> float:
    ref = dict(reference.named_parameters())
    return max(max_abs_difference(p.detach(), ref[n].detach()) for n, p in global_parameters(model).items())


def ep_matches_one_process(rank: int, world_size: int, cases: list[dict], steps: int = 3, tokens: int = 16,
                           aux_coef: float = 0.1, seed: int = 0) -> list[dict[str, Any]]:
    """Each case's expert-parallel layer over all ranks against the one-process layer.

    Each rank holds ``tokens`` tokens; the loss of rank ``r`` is ``(y_r · u_r).sum() + aux_coef · aux_r``
    and the reference's the mean of those over ranks (what :func:`sync_ep_grads` averages to).

    Args:
        cases: :class:`~.moe.MoEConfig` fields per case (and optionally ``expert_compute``).
        steps: AdamW steps after the first forward and backward.

    Returns:
        Per case: largest differences of ``output``, ``input_grad``, ``aux_loss``, every parameter's
        gradient (``grads``: name -> difference) and of the parameters after ``steps`` AdamW steps
        (``after_steps``); ``dropped`` (choices dropped on this rank); ``counts`` (kept choices per
        expert on this rank, and in the reference's group).
    """
    results = []
    with Mesh(ep=world_size).build(timeout=60.0) as pm:
        group, device = pm.group("ep"), rank_device()
        for n, fields in enumerate(cases):
            reference, layer = _layers(fields, world_size, group, seed + n)
            layer.to(device)  # the rank's GPU under NCCL; the reference stays on the CPU
            config = reference.config
            data = torch.Generator().manual_seed(100 + n)
            x = torch.randn(world_size * tokens, HIDDEN, generator=data)
            u = torch.randn(world_size * tokens, HIDDEN, generator=data)
            mine = slice(rank * tokens, (rank + 1) * tokens)
            x_ref, x_mine = x.clone().requires_grad_(True), x[mine].to(device).clone().requires_grad_(True)
            y_ref = reference(x_ref)
            ((y_ref * u).sum() / world_size + aux_coef * reference.aux_loss).backward()
            y = layer(x_mine)
            ((y * u[mine].to(device)).sum() + aux_coef * layer.aux_loss).backward()
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
                y = layer(x[mine].to(device))
                ((y * u[mine].to(device)).sum() + aux_coef * layer.aux_loss).backward()
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
        layer = ExpertParallelMoE(MoE(HIDDEN, INNER, config, seed=7), pm.group("ep")).to(rank_device())
        if capacity_factor is None:
            balanced_router(layer, n_experts)
            x = torch.zeros(tokens, HIDDEN)
            x[torch.arange(tokens), (torch.arange(tokens) + rank) % n_experts] = 1.0
        else:
            x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(rank))
        x = x.to(rank_device()).requires_grad_(True)
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
            try:
                exchange_counts(torch.zeros(world_size, dtype=torch.int64), group, timeout=1.0)
            except TimeoutError as error:
                out["timeout"] = f"TimeoutError: {error}"
        else:
            time.sleep(3.0)  # present, but never joining: rank 0 times out before this rank leaves
    return out


def ep_idle_rank(rank: int, world_size: int) -> dict[str, Any]:
    """Every token of every rank chooses expert 0 (on rank 0): the other ranks receive no rows, and the input
    needs no gradient. Forward and backward must still meet in every all-to-all.

    Returns:
        ``received`` (rows this rank's experts computed), ``expert_grad`` (largest |gradient| of this rank's
        experts), ``router_grad`` (whether the router got a nonzero gradient).
    """
    config = MoEConfig(n_experts=2 * world_size, top_k=1)
    with Mesh(ep=world_size).build(timeout=60.0) as pm:
        layer = ExpertParallelMoE(MoE(HIDDEN, INNER, config, seed=3), pm.group("ep"))
        with torch.no_grad():
            layer.router.gate.weight.zero_()
            layer.router.gate.weight[0] = 1.0
        x = torch.rand(8, HIDDEN) + 0.1  # all positive: expert 0 scores highest for every token
        y = layer(x)
        y.pow(2).sum().backward()
        sync_ep_grads(layer, pm.group("ep"))
        return dict(received=layer.received,
                    expert_grad=max(float(p.grad.abs().max()) for p in layer.experts.parameters()),
                    router_grad=bool(layer.router.gate.weight.grad.abs().sum() > 0))


def ep_census(rank: int, world_size: int, fields: dict, vocab: int = 64) -> dict[str, int]:
    """The tensor census of one rank of the expert-parallel tiny GPT-2 after one AdamW step (fp32).

    Returns:
        ``parameters`` (elements this rank holds), and the bytes of its ``params``, ``grads`` and AdamW
        ``moments`` (``exp_avg`` and ``exp_avg_sq``), each tensor's storage counted once.
    """
    with Mesh(ep=world_size).build(timeout=60.0) as pm:
        model = parallelize_ep(moe_gpt2(build_model("tiny", vocab, seed=1), MoEConfig(**fields), seed=5), pm)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(rank))
        (model.loss(model(ids[:, :-1]), ids[:, 1:]) + 0.01 * aux_loss_of(model)).backward()
        sync_ep_grads(model, pm.group("ep"))
        optimizer.step()
        params = list(model.parameters())
        moments = [optimizer.state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq")]

        def nbytes(tensors: Sequence[torch.Tensor]) -> int:
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
            return sum(storages.values())

        return dict(parameters=sum(p.numel() for p in params), params=nbytes(params),
                    grads=nbytes([p.grad for p in params]), moments=nbytes(moments))


# the seeded run that shows the balancing loss at work: top-1 of 2·ep experts, Zipf-distributed tokens
BALANCE_RUN = dict(steps=8, rows=2, seq=16, vocab=64, lr=1e-3, seed=0, zipf=1.2)


def ep_balance(rank: int, world_size: int, aux_coefs: Sequence[float] = (0.0, 0.1)) -> dict[float, Any]:
    """:func:`~.routing_log.log_routing` of :data:`BALANCE_RUN` once per balancing-loss weight, all-to-alls counted.

    Returns:
        ``{aux_coef: this rank's log}``; :func:`~.routing_log.load_by_step` reads the ranks' logs together.
    """
    return {aux: log_routing(rank, world_size, dict(n_experts=2 * world_size, top_k=1), aux, count=True, **BALANCE_RUN)
            for aux in aux_coefs}


def ep_checks(rank: int, world_size: int, cases: list[dict], gpt2_cases: Sequence[dict] = (),
              steps: int = 3, balance: bool = False) -> dict[str, Any]:
    """Every check of one launch: :func:`ep_matches_one_process`, :func:`gpt2_ep_check` of each of
    ``gpt2_cases``, :func:`ep_idle_rank`, :func:`~.routing_log.log_routing`, :func:`ep_traffic_counted`
    balanced and with drops, :func:`ep_census`, with ``balance`` :func:`ep_balance`, and :func:`ep_refusals`
    last (its timed-out exchange leaves the group unusable)."""
    return dict(cases=ep_matches_one_process(rank, world_size, cases, steps),
                census=ep_census(rank, world_size, dict(n_experts=2 * world_size, top_k=2, shared_expert=True)),
                balance=ep_balance(rank, world_size) if balance else None,
                gpt2=[gpt2_ep_check(rank, world_size, fields) for fields in gpt2_cases],
                idle=ep_idle_rank(rank, world_size),
                log=log_routing(rank, world_size, dict(n_experts=2 * world_size, top_k=2, capacity_factor=1.0),
                                steps=3),
                traffic=ep_traffic_counted(rank, world_size, n_experts=2 * world_size),
                traffic_dropped=ep_traffic_counted(rank, world_size, n_experts=2 * world_size, capacity_factor=1.0),
                refusals=ep_refusals(rank, world_size))


def gpt2_ep_check(rank: int, world_size: int, fields: dict, steps: int = 2, rows: int = 2, seq: int = 8,
                  aux_coef: float = 0.01, vocab: int = 64) -> dict[str, Any]:
    """The one GPT-2 with mixture MLPs spread over all ranks (:func:`~.parallelize.parallelize_ep`) against
    the same model in one process (``token_groups = ep``), each rank holding ``rows`` rows of the batch.

    Each rank's loss is its rows' cross-entropy plus ``aux_coef`` times its balancing losses; the
    reference's is the mean over ranks of the same.

    Returns:
        Largest differences of this rank's ``logits``, every parameter's gradient (``grads``), the
        parameters after ``steps`` AdamW steps (``after_steps``); the ``losses`` of both per step;
        ``dropped`` choices on this rank in the first step.
    """
    config = MoEConfig(**fields)
    mine = slice(rank * rows, (rank + 1) * rows)
    with Mesh(ep=world_size).build(timeout=60.0) as pm:
        reference = moe_gpt2(build_model("tiny", vocab, seed=1), config, token_groups=world_size, seed=5)
        model = parallelize_ep(moe_gpt2(build_model("tiny", vocab, seed=1), config, seed=5), pm)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = torch.Generator().manual_seed(11)
        out: dict[str, Any] = dict(losses=[], reference_losses=[])
        for step in range(steps):
            ids = torch.randint(0, vocab, (world_size * rows, seq + 1), generator=data)
            inputs, labels = ids[:, :-1], ids[:, 1:]
            for o in (ref_opt, opt):
                o.zero_grad(set_to_none=True)
            ref_logits = reference(inputs)
            ref_loss = torch.stack([reference.loss(ref_logits[r * rows:(r + 1) * rows], labels[r * rows:(r + 1) * rows])
                                    for r in range(world_size)]).mean() + aux_coef * aux_loss_of(reference)
            ref_loss.backward()
            logits = model(inputs[mine])
            loss = model.loss(logits, labels[mine]) + aux_coef * aux_loss_of(model)
            loss.backward()
            sync_ep_grads(model, pm.group("ep"))
            if step == 0:
                out.update(logits=max_abs_difference(logits, ref_logits[mine]),
                           grads=_grad_differences(reference, model),
                           dropped=sum(m.last.dropped for m in model.modules() if isinstance(m, ExpertParallelMoE)))
            for p in reference.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            ref_opt.step(), opt.step()
            out["losses"].append(float(loss.detach()))
            out["reference_losses"].append(float(ref_loss.detach()))
        out["after_steps"] = _state_difference(reference, model)
        return out
