"""What the planner answers: the strategies' names, one priced layout (:class:`Option`), the
whole answer (:class:`Plan`), and the bytes a collective sends.

Kept apart from the planner's search (``strategy.py``) so that every strategy's pricing
(``strategy.py`` for DP, MP and PP; ``sharded_tensor.py`` for ZeRO and TP) builds the same record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from parallel_lib.common.checks import positive_int
from parallel_lib.cost.alpha_beta import allreduce_cost
from parallel_lib.model_parallel.memory import GiB

if TYPE_CHECKING:
    from parallel_lib.planner.hardware import Links
    from parallel_lib.planner.strategy import _Inputs

__all__ = ["PART_ONE", "STRATEGIES", "WHEN_TO_USE", "Option", "Plan", "ring_bytes", "p2p_bytes"]


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
    comm_seconds: float            # both, each on the link its group crosses (the plan's Links)
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


PART_ONE = ("DP", "MP", "PP", "DP×PP")  # chapters 01-05, the default
STRATEGIES = PART_ONE + ("ZeRO", "TP×DP")  # with chapters 06 and 07; ZeRO options are named by stage: "ZeRO-2"
# The rule of thumb behind each row of the comparison table; the planner's numbers back it.
WHEN_TO_USE = {
    "DP": "the model with its optimizer state fits on one device: use every device, no bubble",
    "MP": "the model does not fit on one device and speed does not matter (inference, a first try)",
    "PP": "the model does not fit on one device: split it, and fill the pipeline with micro-batches",
    "DP×PP": "a copy of the model needs a few devices and there are many: replicate the pipeline",
    "ZeRO": "the training state does not fit a replica but one layer's work does: shard the state over the "
            "data-parallel ranks (chapter 06), at the price of more traffic from stage 3 on",
    "TP×DP": "one layer's weights or activations are too big for a device: split every layer inside a node "
             "(chapter 07), and replicate the node's group",
}


@dataclass(frozen=True)
class Plan:
    """Every strategy's :class:`Option` for one model, batch and cluster, and the pick."""

    model: str
    n_params: int
    seq_len: int
    batch_size: int
    gpu_bytes: float
    n_gpus: int
    links: "Links"
    options: tuple[Option, ...]
    inputs: "_Inputs" = field(repr=False, compare=False, default=None)  # type: ignore[assignment]

    def fits(self, stages: int, replicas: int) -> bool:
        """Whether ``replicas`` copies of the model, each split over ``stages`` GPUs, fit (no recomputation).

        One stage is data parallelism (with gradient accumulation when allowed); a pipeline runs its
        micro-batches. This is the test behind the DP×PP option and :attr:`layout`.
        """
        positive_int("stages", stages)
        positive_int("replicas", replicas)
        return self.inputs.fits(stages, replicas) is not None

    @property
    def layout(self) -> Optional[tuple[int, int]]:
        """``(stages, replicas)``: the fewest stages that fit, as many replicas as the GPUs allow; None if none.

        Fewer stages mean a smaller bubble and less traffic between stages; every GPU left goes to
        another replica. Chapter 05's exercise is checked against this very search.
        """
        found = self.inputs.search(1, 1)
        return None if found is None or found.recompute else (found.stages, found.replicas)

    @property
    def best(self) -> Optional[Option]:
        """The feasible option with the most useful compute; less traffic breaks a tie."""
        feasible = [o for o in self.options if o.feasible]
        return max(feasible, key=lambda o: (round(o.busy_devices, 9), -o.comm_bytes), default=None)

    def option(self, strategy: str) -> Option:
        """The option of one strategy (a name from STRATEGIES)."""
        for o in self.options:
            if o.strategy == strategy or o.strategy.startswith(f"{strategy}-"):  # "ZeRO" finds "ZeRO-2"
                return o
        raise ValueError(f"strategy must be one of {STRATEGIES}, got strategy={strategy!r}")

    def table(self) -> str:
        """A fixed-width table of the options."""
        lines = [f"{self.model}, {self.seq_len} tokens x {self.batch_size} sequences per step, "
                 f"{self.n_gpus} GPU(s) of {self.gpu_bytes / GiB:g} GiB, {self.links}",
                 f"{'strategy':<8} {'layout':>9} {'m':>3} {'GiB/device':>10} {'fits':>4} {'bubble':>6} "
                 f"{'GB sent/device':>14} {'comm s':>7} {'busy GPUs':>9} {'recompute':>9}"]
        for o in self.options:
            lines.append(f"{o.strategy:<8} {f'{o.replicas}x{o.stages}':>9} {o.micro_batches:>3} "
                         f"{o.memory_bytes / GiB:>10.1f} {'yes' if o.feasible else 'no':>4} {o.bubble:>6.0%} "
                         f"{o.comm_bytes / 1e9:>14.3f} {o.comm_seconds:>7.3f} {o.busy_devices:>9.1f} "
                         f"{'yes' if o.recompute else 'no':>9}")
        return "\n".join(lines)

    def explain(self) -> str:
        """The reasoning: each option's reasons, then the pick."""
        lines = []
        for o in self.options:
            lines.append(f"{o.strategy} ({o.replicas} replica(s) x {o.stages} stage(s)): "
                         f"{'feasible' if o.feasible else 'NOT feasible'}")
            lines += [f"  - {reason}" for reason in o.reasons]
        best = self.best
        if best is None:
            lines.append("No strategy fits: add GPUs, use larger ones, shorten the sequences or shrink the batch.")
        else:
            lines.append(f"Pick: {best.strategy}, {best.replicas} x {best.stages}: the most useful compute, "
                         f"{best.devices} GPU(s) x (1 - bubble {best.bubble:.0%})"
                         f"{' x 3/4 (recomputation)' if best.recompute else ''} = "
                         f"{best.busy_devices:.1f} GPUs' worth "
                         f"({WHEN_TO_USE[best.strategy.split('-')[0]]}).")
        return "\n".join(lines)
