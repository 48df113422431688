"""The 3D rank grid: data × tensor × pipeline parallelism, every process group a slice.

Chapter 05's :class:`~parallel_lib.hybrid.grid.RankGrid` lays ``dp * pp`` ranks out as a
``(dp, pp)`` tensor. A third axis, tensor parallelism, makes it ``(dp, pp, tp)``::

    ranks = torch.arange(dp * pp * tp).reshape(dp, pp, tp)   # order "tp-pp-dp": tp fastest
    ranks[d, j, :]   tensor-parallel group: stage j of replica d, split by heads
    ranks[d, :, t]   a pipeline: slice t of every stage of replica d, activations by send/recv
    ranks[:, j, t]   data-parallel group: the same slice of the same stage in every replica

Which axis varies fastest decides which groups hold neighbouring ranks, and in a cluster
neighbouring ranks share a node. Tensor parallelism goes first because it sends the most,
most often and on the critical path (four all-reduces of the activations per block and
micro-batch, nothing to overlap them with), so it needs NVLink inside a node. Megatron-LM
puts tp first too (``parallel_state.initialize_model_parallel``: ``order="tp-cp-ep-dp-pp"`` by
default; its unit tests also run ``"tp-cp-pp-ep-dp"``). Its default puts dp before pp, so pp
varies slowest: a pipeline's send/recv of one micro-batch's activations is the smallest
traffic and can cross the slowest links. This course's default is ``"tp-pp-dp"``, the other order:
it extends chapter 05's ``(dp, pp)`` grid, one replica a block of neighbouring ranks, so a
replica that fits in one node keeps all its traffic but the gradient all-reduce inside it.
``order="tp-dp-pp"`` gives Megatron's default; the groups are slices either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from parallel_lib.common.checks import positive_int

__all__ = ["ORDERS", "Grid3D", "Groups3D", "new_groups_3d"]

# fastest-varying axis first, as Megatron-LM writes its orders
ORDERS = ("tp-pp-dp", "tp-dp-pp")


@dataclass(frozen=True)
class Grid3D:
    """``dp`` replicas of a ``pp``-stage pipeline whose stages are split over ``tp`` ranks.

    ``grid.ranks[d, j, t]`` is the global rank that holds tensor slice t of stage j of replica d.
    Any axis may be 1.
    """

    dp: int
    tp: int
    pp: int
    order: str = "tp-pp-dp"

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            positive_int(name, getattr(self, name))
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS} (fastest axis first), got order={self.order!r}")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def ranks(self) -> Tensor:
        """The layout as a ``(dp, pp, tp)`` tensor of global ranks."""
        n = torch.arange(self.world_size)
        if self.order == "tp-pp-dp":
            return n.reshape(self.dp, self.pp, self.tp)
        return n.reshape(self.pp, self.dp, self.tp).transpose(0, 1)  # "tp-dp-pp": pp slowest

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(replica d, stage j, tensor slice t)`` of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got rank={rank!r}")
        d, j, t = (int(i) for i in (self.ranks == rank).nonzero()[0])
        return d, j, t

    def tp_ranks(self, d: int, j: int) -> list[int]:
        """The tensor-parallel group of stage j in replica d: ``ranks[d, j, :]``."""
        return self.ranks[d, j, :].tolist()

    def pp_ranks(self, d: int, t: int) -> list[int]:
        """The pipeline of slice t in replica d, stage by stage: ``ranks[d, :, t]``."""
        return self.ranks[d, :, t].tolist()

    def dp_ranks(self, j: int, t: int) -> list[int]:
        """The data-parallel group of slice t of stage j: ``ranks[:, j, t]``."""
        return self.ranks[:, j, t].tolist()

    def tied_ranks(self, d: int, t: int) -> list[int]:
        """First and last stage of pipeline (d, t): both hold vocabulary slice t of the tied embedding."""
        return sorted({self.ranks[d, 0, t].item(), self.ranks[d, -1, t].item()})

    def groups(self) -> dict[str, list[list[int]]]:
        """Every group of every kind, in the order :func:`new_groups_3d` creates them."""
        return {"tp": [self.tp_ranks(d, j) for d in range(self.dp) for j in range(self.pp)],
                "pp": [self.pp_ranks(d, t) for d in range(self.dp) for t in range(self.tp)],
                "dp": [self.dp_ranks(j, t) for j in range(self.pp) for t in range(self.tp)],
                "tied": [self.tied_ranks(d, t) for d in range(self.dp) for t in range(self.tp)] if self.pp > 1
                else []}

    def __str__(self) -> str:
        lines = [f"dp={self.dp} x tp={self.tp} x pp={self.pp} = {self.world_size} ranks, order {self.order}"]
        width = len(str(self.world_size - 1))
        for d in range(self.dp):
            lines.append(f"replica {d}: " + "   ".join(
                f"stage {j} [" + " ".join(f"{r:>{width}}" for r in self.tp_ranks(d, j)) + "]"
                for j in range(self.pp)))
        return "\n".join(lines)


@dataclass
class Groups3D:
    """This rank's process groups (None where the group would hold this rank alone, except ``tp``)."""

    tp: Any    # always a group, also of one rank: the tensor-parallel code treats None as "every rank"
    dp: Any
    tied: Any
    made: list[Any]  # every group this rank created, to destroy after the run


def new_groups_3d(grid: Grid3D, rank: int, timeout: float) -> Groups3D:
    """Create every group of the grid (a collective: every rank, every group, one order); keep this rank's.

    ``dist.new_group`` must be called by every rank for every group, even groups it is not in.
    """
    import torch.distributed as dist

    wait = timedelta(seconds=timeout)
    mine: dict[str, Any] = {"tp": None, "dp": None, "tied": None}
    made = []
    for kind, lists in grid.groups().items():
        if kind == "pp":  # a pipeline talks by send/recv on the default group: no group needed
            continue
        for ranks in lists:
            if kind != "tp" and len(ranks) == 1:
                continue
            group = dist.new_group(ranks, timeout=wait)
            made.append(group)
            if rank in ranks:
                mine[kind] = group
    return Groups3D(mine["tp"], mine["dp"], mine["tied"], made)
