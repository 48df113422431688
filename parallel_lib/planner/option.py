"""One layout the planner priced: :class:`Option`, and the bytes its collectives send.

Kept apart from the planner's search (``strategy.py``) so that every strategy's pricing
(``strategy.py`` for DP, MP and PP; ``sharded_tensor.py`` for ZeRO and TP) builds the same record.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from parallel_lib.data_parallel.ring import allreduce_cost

__all__ = ["Option", "ring_bytes", "p2p_bytes"]


def ring_bytes(nbytes: float, world_size: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``nbytes``: ``2 (N - 1) / N * nbytes``."""
    return allreduce_cost(nbytes, world_size, bandwidth=1.0, latency=0.0)


def p2p_bytes(boundary_bytes: float, stages: int) -> float:
    """Bytes the busiest stage sends per step: its output forward and its input's gradient backward.

    ``boundary_bytes`` is one batch's hidden states at one stage boundary; an inner stage
    sends both directions (2x), the first and last only one, a single stage nothing.
    """
    return boundary_bytes * min(2, stages - 1) if stages > 1 else 0.0


@dataclass(frozen=True)
class Option:
    """One strategy on the given cluster: its layout, memory, idle share and traffic."""

    strategy: str                  # one of STRATEGIES
    replicas: int                  # data-parallel copies of the model
    stages: int                    # devices one copy is split over
    micro_batches: int             # per replica and step
    state_bytes: float             # weights, gradients, master copy, optimizer states per device
    activation_bytes: float        # kept for backward on the busiest device
    bubble: float                  # idle share of each device's step
    allreduce_bytes: float         # gradient all-reduce, sent per device per step
    p2p_bytes: float               # hidden states and their gradients, sent per device per step
    comm_seconds: float            # both, at the plan's link bandwidth
    feasible: bool
    reasons: tuple[str, ...] = field(default=())
    recompute: bool = False        # activation recomputation (torch.utils.checkpoint per block)

    @property
    def memory_bytes(self) -> float:
        return self.state_bytes + self.activation_bytes

    @property
    def devices(self) -> int:
        return self.replicas * self.stages

    @property
    def comm_bytes(self) -> float:
        return self.allreduce_bytes + self.p2p_bytes

    @property
    def busy_devices(self) -> float:
        """Devices' worth of useful compute: ``devices * (1 - bubble)``, x 3/4 under recomputation.

        Backward costs about twice the forward; recomputing the forward makes a step 4 units of
        work instead of 3 (Korthikanti et al. 2022, sec. 5: "about 33% overhead").
        """
        return self.devices * (1 - self.bubble) * (0.75 if self.recompute else 1.0)
