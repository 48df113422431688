"""The mixture-of-experts layer, in one process: the reference every expert-parallel run is proved against.

::

    x (..., h) ─ flatten to T tokens ─ router: top-k of softmax(x W_g) ─ capacity: keep each expert's first C
        └─ for every expert e: y[t] += w[t, j] · expert_e(x[t])   for each kept choice (t, j) of e
        └─ + shared_expert(x)  (DeepSeekMoE: one expert every token uses)     ─ dropout ─ (..., h)

A drop-in for GPT-2's MLP (:class:`parallel_lib.models.MLP`): same input and output shapes.
A dropped choice adds nothing; the block's residual carries the token on. The auxiliary
load-balancing loss of the last forward is :attr:`MoE.aux_loss` (add ``α`` times it to the
training loss; :func:`aux_loss_of` sums it over a model).

The tokens are routed in ``token_groups`` equal, contiguous groups (GShard's groups): capacity
is filled and the balancing loss computed per group (then averaged). With expert parallelism
each of the ``ep`` ranks routes its own tokens, so this layer with ``token_groups=ep`` on the
ranks' tokens concatenated computes exactly what they compute together
(:mod:`.expert_parallel_moe`).

The loop over experts is the plainest form; it is the reference, not the fast path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from parallel_lib.common.checks import check_int, check_number, positive_int
from parallel_lib.expert_parallel.balance import load_balancing_loss, tokens_per_expert
from parallel_lib.expert_parallel.capacity import expert_capacity, keep_within_capacity
from parallel_lib.expert_parallel.expert import Expert
from parallel_lib.expert_parallel.router import Router

__all__ = ["MoEConfig", "RoutingRecord", "MoE", "route_tokens", "aux_loss_of"]


@dataclass(frozen=True)
class MoEConfig:
    """What a mixture-of-experts layer is (the widths come from the MLP it replaces)."""

    n_experts: int = 4                       # E routed experts
    top_k: int = 1                           # experts per token (Switch: 1; Mixtral: 2; DeepSeek-V3: 8)
    capacity_factor: Optional[float] = None  # slots per expert over the fair share; None: drop nothing
    shared_expert: bool = False              # one more expert that every token uses (DeepSeekMoE)
    normalize: bool = False                  # rescale each token's k weights to sum to 1 (Mixtral)

    def __post_init__(self) -> None:
        positive_int("n_experts", self.n_experts)
        check_int("top_k", self.top_k, 1, self.n_experts, hint="a token cannot choose more experts than there are")
        if self.capacity_factor is not None:
            check_number("capacity_factor", self.capacity_factor, 0.0, strict=True,
                         hint="use e.g. 1.0 or 1.25, or None for no limit")
        for name in ("shared_expert", "normalize"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {name}={getattr(self, name)!r}")


@dataclass
class RoutingRecord:
    """What one forward routed: the run's own record, which the counts and the widget read."""

    experts: torch.Tensor   # (T, k) chosen experts
    weights: torch.Tensor   # (T, k) their weights (differentiable)
    kept: torch.Tensor      # (T, k) bool: False where capacity dropped the choice
    aux_loss: torch.Tensor  # 0-d: the balancing loss, mean over groups (differentiable)
    capacity: Optional[int]  # slots per expert and group (None: no limit)
    groups: int
    n_experts: int

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        """Kept choices per expert, (E,)."""
        return tokens_per_expert(self.experts, self.n_experts, self.kept)

    @property
    def dropped(self) -> int:
        """Choices capacity dropped."""
        return int((~self.kept).sum())


def route_tokens(router: Router, x: torch.Tensor, config: MoEConfig, groups: int = 1) -> RoutingRecord:
    """Route ``x`` (T, h) in ``groups`` contiguous groups: choices, capacity and balancing loss per group.

    Raises:
        ValueError: ``groups`` does not divide the tokens.
    """
    positive_int("groups", groups)
    tokens = x.shape[0]
    if tokens % groups:
        raise ValueError(f"token_groups={groups} must divide the {tokens} tokens (each expert-parallel rank routes "
                         "an equal share); use a batch divisible by it")
    routing = router(x)
    capacity = expert_capacity(tokens // groups, config.n_experts, config.top_k, config.capacity_factor)
    kept, losses = [], []
    for probs, experts in zip(routing.probs.chunk(groups), routing.experts.chunk(groups)):
        kept.append(keep_within_capacity(experts, config.n_experts, capacity))
        losses.append(load_balancing_loss(probs, experts))
    return RoutingRecord(routing.experts, routing.weights, torch.cat(kept), torch.stack(losses).mean(), capacity,
                         groups, config.n_experts)


class MoE(nn.Module):
    """A mixture of GPT-2-MLP-shaped experts (see the module docstring).

    Args:
        hidden: the token width ``h``.
        inner: each expert's inner width (GPT-2: ``4h``).
        config: a :class:`MoEConfig`.
        token_groups: groups the tokens are routed in (capacity and loss per group).
        seed: the seed of the initial weights (N(0, 0.02), biases 0), drawn off the caller's stream.
        dropout: applied to the output (the replaced MLP's dropout); default none.

    Raises:
        TypeError: ``config`` is not a :class:`MoEConfig`.
        ValueError: a width or ``token_groups`` below 1.
    """

    def __init__(self, hidden: int, inner: int, config: MoEConfig, token_groups: int = 1, seed: int = 0,
                 dropout: Optional[nn.Module] = None) -> None:
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
        self.config, self.token_groups = config, positive_int("token_groups", token_groups)
        self.router = Router(positive_int("hidden", hidden), config.n_experts, config.top_k, config.normalize)
        self.experts = nn.ModuleList(Expert(hidden, positive_int("inner", inner)) for _ in range(config.n_experts))
        self.shared_expert = Expert(hidden, inner) if config.shared_expert else None
        self.dropout = dropout if dropout is not None else nn.Identity()
        self.last: Optional[RoutingRecord] = None
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, 0.02)

    @property
    def aux_loss(self) -> torch.Tensor:
        """The balancing loss of the last forward.

        Raises:
            RuntimeError: no forward has run yet.
        """
        if self.last is None:
            raise RuntimeError("aux_loss is the last forward's: run the layer first")
        return self.last.aux_loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])                                # (T, h)
        self.last = record = route_tokens(self.router, flat, self.config, self.token_groups)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.nonzero((record.experts == e) & record.kept, as_tuple=True)
            if token.numel():
                weight = record.weights[token, slot, None].to(flat.dtype)  # (n_e, 1)
                out = out.index_add(0, token, weight * expert(flat[token]))
        if self.shared_expert is not None:
            out = out + self.shared_expert(flat)
        return self.dropout(out.reshape(x.shape))


def aux_loss_of(model: nn.Module) -> torch.Tensor:
    """The sum of every mixture layer's balancing loss in ``model`` from its last forward.

    Raises:
        ValueError: ``model`` holds no mixture-of-experts layer.
    """
    losses = [m.aux_loss for m in model.modules() if hasattr(m, "last") and isinstance(getattr(m, "config", None),
                                                                                       MoEConfig)]
    if not losses:
        raise ValueError("model holds no mixture-of-experts layer: swap its MLPs first (moe_gpt2 / parallelize_ep)")
    return torch.stack(losses).sum()
