"""The rank grid: ranks laid out as a tensor, every process group a slice of it.

picotron's lesson: ``torch.arange(world_size).reshape(dp, pp)`` makes the layout
printable, testable and easy to draw; row d is one pipeline, column j the
data-parallel group of stage j.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from parallel_lib.common.checks import positive_int

__all__ = ["RankGrid", "new_groups"]


@dataclass(frozen=True)
class RankGrid:
    """``dp`` pipeline replicas of ``pp`` stages: rank ``grid[d, j]`` runs stage j of replica d."""

    dp: int
    pp: int

    def __post_init__(self) -> None:
        positive_int("dp", self.dp)
        positive_int("pp", self.pp)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp

    @property
    def ranks(self) -> Tensor:
        """The layout, ``(dp, pp)``: row d is a pipeline, column j a data-parallel group."""
        return torch.arange(self.world_size).reshape(self.dp, self.pp)

    def coords(self, rank: int) -> tuple[int, int]:
        """``(replica d, stage j)`` of a rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got rank={rank!r}")
        d, j = divmod(rank, self.pp)
        return d, j

    def pipeline_ranks(self, d: int) -> list[int]:
        """Stages of replica d, in order: ``grid[d, :]``."""
        return self.ranks[d, :].tolist()

    def dp_ranks(self, j: int) -> list[int]:
        """Stage j of every replica: ``grid[:, j]``, the ranks that average stage j's gradients."""
        return self.ranks[:, j].tolist()

    def tied_ranks(self, d: int) -> list[int]:
        """First and last stage of replica d (one rank when pp == 1): they share GPT-2's tied embedding."""
        return sorted({self.ranks[d, 0].item(), self.ranks[d, -1].item()})

    def __str__(self) -> str:
        head = "           " + "".join(f"stage {j:<3}" for j in range(self.pp))
        rows = [f"replica {d:<3}" + "".join(f"rank {r:<4}" for r in self.pipeline_ranks(d)) for d in range(self.dp)]
        return "\n".join([head, *rows])


def new_groups(grid: RankGrid, timeout: float) -> tuple[list[Any], list[Any]]:
    """(dp group of every stage, tied group of every replica); every rank creates all, in one order.

    ``dist.new_group`` is collective: every rank must call it for every group, in the same
    order, even for groups it is not in.
    """
    wait = timedelta(seconds=timeout)
    dp_groups = [dist.new_group(grid.dp_ranks(j), timeout=wait) for j in range(grid.pp)]
    tied_groups = [dist.new_group(grid.tied_ranks(d), timeout=wait) for d in range(grid.dp)] if grid.pp > 1 else []
    return dp_groups, tied_groups
