"""What chapter 05's planner answers: the strategies' names, one priced named layout (:class:`Option`), the
whole answer (:class:`Plan`).

Records only: every byte and second in them is a :class:`~parallel_lib.planner.layout.Priced` of
:func:`~parallel_lib.planner.layout.price`, the one pricing that chapter 10's search uses too; the
search that fills them is ``strategy.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from parallel_lib.common.checks import positive_int
from parallel_lib.cost.shape import GPTShape
from parallel_lib.cost.units import GiB
from parallel_lib.planner.layout import Layout, Priced, rank_parameters

if TYPE_CHECKING:
    from parallel_lib.planner.hardware import Links
    from parallel_lib.planner.strategy import _Inputs

__all__ = ["PART_ONE", "STRATEGIES", "WHEN_TO_USE", "Option", "Plan"]


@dataclass(frozen=True)
class Option:
    """One named strategy on the given cluster: the layout it runs as, its pricing, and why it fits or not."""

    strategy: str                  # one of STRATEGIES ("ZeRO-2": ZeRO at stage 2)
    layout: Layout
    priced: Priced                 # layout.price of ``layout``: every number below is read from it
    feasible: bool
    reasons: tuple[str, ...] = field(default=())

    @property
    def replicas(self) -> int:
        """Data-parallel copies of the model."""
        return self.layout.dp

    @property
    def stages(self) -> int:
        """Devices one copy is split over: pipeline stages times the tensor-parallel degree."""
        return self.layout.pp * self.layout.tp

    @property
    def micro_batches(self) -> int:
        return self.layout.micro_batches

    @property
    def recompute(self) -> bool:
        return self.layout.recompute

    @property
    def devices(self) -> int:
        return self.layout.devices

    @property
    def state_bytes(self) -> float:
        """Weights, gradients, optimizer states per device, and under ZeRO-3 what it gathers while computing."""
        return self.priced.state_bytes + self.priced.working_bytes

    @property
    def activation_bytes(self) -> float:
        return self.priced.activation_bytes

    @property
    def memory_bytes(self) -> float:
        return self.priced.memory_bytes

    @property
    def bubble(self) -> float:
        """Idle share of a pipeline rank's step: the simulator's idle-to-work ratio as a share of the whole."""
        return self.priced.bubble / (1 + self.priced.bubble)

    @property
    def allreduce_bytes(self) -> float:
        """Sent per device and step over the data-parallel group: the gradient all-reduce, or ZeRO's collectives."""
        return self.priced.sent.get("dp", 0.0)

    @property
    def p2p_bytes(self) -> float:
        """Sent per device and step by the model's split: pipeline hand-overs (and the tied embedding's
        gradient), tensor- and context-parallel collectives."""
        return self.priced.sent_bytes - self.allreduce_bytes

    @property
    def comm_bytes(self) -> float:
        return self.priced.sent_bytes

    @property
    def comm_seconds(self) -> float:
        """Every send's and collective's seconds on the link its group crosses, hidden behind compute or not."""
        return self.priced.comm_seconds

    @property
    def step_seconds(self) -> float:
        """The predicted step at the GPUs' published peak: compute, bubble, exposed communication, optimizer."""
        return self.priced.step_seconds


PART_ONE = ("DP", "MP", "PP", "DP×PP")  # chapters 01-05, the default
STRATEGIES = PART_ONE + ("ZeRO", "TP×DP")  # with chapters 06 and 07; ZeRO options are named by stage: "ZeRO-2"
# The rule of thumb behind each row of the comparison table; the planner's numbers back it.
WHEN_TO_USE = {
    "DP": "the model with its optimizer state fits on one device: use every device, no bubble",
    "MP": "the model does not fit on one device and speed does not matter (inference, a first try)",
    "PP": "the model does not fit on one device: split it, and fill the pipeline with micro-batches",
    "DP×PP": "a copy of the model needs a few devices and there are many: replicate the pipeline",
    "ZeRO": "the training state does not fit a replica but one layer's work does: shard the state over the "
            "data-parallel ranks (chapter 06), at the price of more traffic from stage 2 on with accumulation",
    "TP×DP": "one layer's weights or activations are too big for a device: split every layer inside a node "
             "(chapter 07), and replicate the node's group",
}


@dataclass(frozen=True)
class Plan:
    """Every strategy's :class:`Option` for one model, batch and cluster, and the pick."""

    model: str
    shape: GPTShape
    seq_len: int
    batch_size: int
    gpu_bytes: float
    n_gpus: int
    links: "Links"
    options: tuple[Option, ...]
    inputs: "_Inputs" = field(repr=False, compare=False, default=None)  # type: ignore[assignment]

    @property
    def n_params(self) -> int:
        """The model's parameters (one copy of each: a tied head counted once)."""
        return sum(rank_parameters(self.shape))

    def fits(self, stages: int, replicas: int) -> bool:
        """Whether ``replicas`` copies of the model, each split over ``stages`` GPUs, fit (no recomputation).

        One stage is data parallelism (with gradient accumulation when allowed); a pipeline runs its
        micro-batches. This is the test behind the DP×PP option and :attr:`layout`.
        """
        positive_int("stages", stages)
        positive_int("replicas", replicas)
        return self.inputs.fits_memory(stages, replicas)

    @property
    def layout(self) -> Optional[tuple[int, int]]:
        """``(stages, replicas)``: the fewest stages that fit, as many replicas as the GPUs allow; None if none.

        Fewer stages mean a smaller bubble and less traffic between stages; every GPU left goes to
        another replica. Chapter 05's exercise is checked against this very search (:meth:`fits`).
        """
        return self.inputs.layout()

    @property
    def best(self) -> Optional[Option]:
        """The feasible option with the shortest predicted step; less memory breaks a tie."""
        feasible = [o for o in self.options if o.feasible]
        return min(feasible, key=lambda o: (o.step_seconds, o.memory_bytes), default=None)

    def option(self, strategy: str) -> Option:
        """The option of one strategy (a name from STRATEGIES)."""
        for o in self.options:
            if o.strategy == strategy or o.strategy.startswith(f"{strategy}-"):  # "ZeRO" finds "ZeRO-2"
                return o
        raise ValueError(f"strategy must be one of {[o.strategy for o in self.options]}, got strategy={strategy!r}")

    def table(self) -> str:
        """A fixed-width table of the options."""
        lines = [f"{self.model}, {self.seq_len} tokens x {self.batch_size} sequences per step, "
                 f"{self.n_gpus} GPU(s) of {self.gpu_bytes / GiB:g} GiB, {self.links}",
                 f"{'strategy':<8} {'layout':>9} {'m':>3} {'GiB/device':>10} {'fits':>4} {'bubble':>6} "
                 f"{'GB sent/device':>14} {'comm s':>7} {'step s':>7} {'recompute':>9}"]
        for o in self.options:
            lines.append(f"{o.strategy:<8} {f'{o.replicas}x{o.stages}':>9} {o.micro_batches:>3} "
                         f"{o.memory_bytes / GiB:>10.1f} {'yes' if o.feasible else 'no':>4} {o.bubble:>6.0%} "
                         f"{o.comm_bytes / 1e9:>14.3f} {o.comm_seconds:>7.3f} {o.step_seconds:>7.3f} "
                         f"{'yes' if o.recompute else 'no':>9}")
        return "\n".join(lines)

    def explain(self) -> str:
        """The reasoning: each option's reasons, then the pick."""
        lines = []
        for o in self.options:
            lines.append(f"{o.strategy} ({o.replicas} replica(s) x {o.stages} GPU(s) each, {o.layout.name}): "
                         f"{'feasible' if o.feasible else 'NOT feasible'}")
            lines += [f"  - {reason}" for reason in o.reasons]
        best = self.best
        if best is None:
            lines.append("No strategy fits: add GPUs, use larger ones, shorten the sequences or shrink the batch.")
        else:
            lines.append(f"Pick: {best.strategy}, {best.replicas} x {best.stages}: the shortest predicted step, "
                         f"{best.step_seconds:.2f} s at the GPUs' published peak "
                         f"({WHEN_TO_USE[best.strategy.split('-')[0]]}).")
        return "\n".join(lines)
