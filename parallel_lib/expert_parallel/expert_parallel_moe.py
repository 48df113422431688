"""Expert parallelism: the experts spread over the ``ep`` ranks, tokens sent to them and back by all-to-all.

Each of the ``ep`` ranks holds ``E/ep`` experts (rank ``q``: experts ``q·E/ep .. (q+1)·E/ep - 1``)
and its own tokens; the router and the shared expert are replicated. One forward::

    [1] route my tokens (top-k, capacity, balancing loss), exactly as the one-process layer does
    [2] sort my kept choices by expert; count them per expert           counts (E,)
    [3] all-to-all of the counts: what every rank sends to my experts   (ep, E/ep)
    [4] all-to-all of the rows, uneven splits: to the rank of their expert
    [5] each of my experts runs on the rows for it (from every rank)
    [6] the reverse all-to-all: every row back to the rank it came from
    [7] combine: y[t] += w[t, j] · row, for each kept choice; + shared expert

The backward runs [6] and [4] in reverse, as two all-to-alls of gradients
(:class:`~.uneven_all_to_all.AllToAll`): an expert's weights collect the gradient of every token
it served, from every rank. The replicated parts are data-parallel over ``ep``:
:func:`sync_ep_grads` averages their gradients (and scales the experts' to match), after which
the parameters follow the one-process layer's step for step (proved in
``tests/test_expert_parallel_ranks.py``).
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from parallel_lib.common.checks import check_choice, positive_number
from parallel_lib.expert_parallel.expert_compute import EXPERT_COMPUTE, run_experts
from parallel_lib.expert_parallel.uneven_all_to_all import _wait, all_to_all, exchange_counts
from parallel_lib.expert_parallel.moe import MoE, RoutingRecord, route_tokens

__all__ = ["ExpertParallelMoE", "sync_ep_grads", "expert_parameters"]


class ExpertParallelMoE(nn.Module):
    """This rank's share of a :class:`~.moe.MoE`: the router, the shared expert, and its ``E/ep`` experts.

    Args:
        moe: the whole layer, built the same on every rank (same seed); it is taken apart, not copied.
        group: the expert-parallel process group (``mesh.group("ep")``).
        timeout: seconds each all-to-all may wait.
        expert_compute: "loop" (one multiply per expert) or "grouped" (one for all; :mod:`.expert_compute`).

    Raises:
        TypeError: ``moe`` is not a :class:`~.moe.MoE`.
        ValueError: the group's size does not divide the number of experts; an unknown ``expert_compute``.
    """

    def __init__(self, moe: MoE, group: Any, timeout: float = 60.0, expert_compute: str = "loop") -> None:
        super().__init__()
        self.expert_compute = check_choice("expert_compute", expert_compute, EXPERT_COMPUTE)
        if not isinstance(moe, MoE):
            raise TypeError(f"moe must be a MoE (the one-process layer, same seed on every rank), got "
                            f"{type(moe).__name__}")
        self.group, self.timeout = group, positive_number("timeout", timeout)
        self.ep, self.ep_rank = dist.get_world_size(group), dist.get_rank(group)
        self.config = moe.config
        n = self.config.n_experts
        if n % self.ep:
            raise ValueError(f"the ep group's {self.ep} ranks must divide n_experts={n}: each rank holds n/ep experts")
        self.local = n // self.ep
        self.first_expert = self.ep_rank * self.local
        self.router, self.shared_expert, self.dropout = moe.router, moe.shared_expert, moe.dropout
        self.experts = nn.ModuleList(moe.experts[self.first_expert:self.first_expert + self.local])
        self.last: Optional[RoutingRecord] = None
        self.received = 0  # rows this rank's experts computed in the last forward (its load)
        self.compute_s = 0.0  # seconds its experts took on them in the last forward (the straggler's cost)

    @property
    def aux_loss(self) -> torch.Tensor:
        """The balancing loss of this rank's tokens in the last forward."""
        if self.last is None:
            raise RuntimeError("aux_loss is the last forward's: run the layer first")
        return self.last.aux_loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])                                               # (T, h) my tokens
        self.last = record = route_tokens(self.router, flat, self.config)               # [1]
        token, slot = torch.nonzero(record.kept, as_tuple=True)
        order = torch.argsort(record.experts[token, slot], stable=True)                 # [2] by expert
        token, slot = token[order], slot[order]
        counts = torch.bincount(record.experts[token, slot], minlength=self.config.n_experts)
        incoming = exchange_counts(counts, self.group, self.timeout)                    # [3] (ep, E/ep)
        send = counts.reshape(self.ep, self.local).sum(1).tolist()
        receive = incoming.sum(1).tolist()
        rows = all_to_all(flat[token], send, receive, self.group, self.timeout)         # [4] by source, expert
        self.received = rows.shape[0]
        expert_of_row = torch.arange(self.local, device=rows.device).repeat(self.ep).repeat_interleave(
            incoming.reshape(-1))
        start = time.perf_counter()
        done = run_experts(self.experts, rows, expert_of_row, self.expert_compute)      # [5]
        self.compute_s = time.perf_counter() - start
        back = all_to_all(done, receive, send, self.group, self.timeout)                # [6] my rows again
        weight = record.weights[token, slot, None].to(flat.dtype)
        out = torch.zeros_like(flat).index_add(0, token, weight * back)                # [7]
        if self.shared_expert is not None:
            out = out + self.shared_expert(flat)
        return self.dropout(out.reshape(x.shape))


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of every :class:`ExpertParallelMoE`'s own experts in ``model`` (not replicated over ep)."""
    return [p for m in model.modules() if isinstance(m, ExpertParallelMoE) for p in m.experts.parameters()]


def sync_ep_grads(model: nn.Module, group: Any, timeout: float = 60.0) -> None:
    """After ``backward`` of each rank's own loss: the gradients of the mean of the ranks' losses.

    The replicated parameters (router, shared expert, and in a whole model attention,
    embeddings, norms) are averaged over ``group`` in one all-reduce; each rank's own experts
    already hold the sum over every rank's tokens and are divided by ``ep``. A parameter with
    no gradient (an expert no token reached) gets zeros, as in the one-process layer.

    Raises:
        TimeoutError: the all-reduce did not finish in time (names this rank).
    """
    ep = dist.get_world_size(group)
    experts = {id(p) for p in expert_parameters(model)}
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    replicated = [p for p in model.parameters() if p.requires_grad and id(p) not in experts]
    if replicated:
        flat = torch.cat([p.grad.reshape(-1) for p in replicated])
        _wait(dist.all_reduce(flat, group=group, async_op=True), timeout, "the all-reduce of replicated gradients",
              group)
        flat /= ep
        for p, g in zip(replicated, flat.split([p.numel() for p in replicated])):
            p.grad.copy_(g.view_as(p))
    for p in model.parameters():
        if id(p) in experts:
            p.grad /= ep
