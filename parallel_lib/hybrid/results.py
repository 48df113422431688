"""What the ranks of a DP x PP run return, and the job's numbers computed from them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Sequence

from torch import Tensor

from parallel_lib.common.compare import max_abs_difference
from parallel_lib.common.timeline import Event
from parallel_lib.common.training import TrainRecord

if TYPE_CHECKING:  # the config's module imports this one
    from parallel_lib.hybrid.dp_pp import HybridConfig

__all__ = ["HybridResult", "summarize", "gather_state", "compare_with_reference", "HEAD_COPY"]

HEAD_COPY = "lm_head.weight"  # the last stage's copy of the tied embedding, by the unsplit model's name


@dataclass
class HybridResult:
    """What one rank measured; ``bytes_*`` are payload bytes per step handed to the network by this rank.

    ``record`` is the course's timed-step record: per step, this rank's seconds (batch loaded
    to optimizer step), the GLOBAL batch's target tokens and, on a last stage, this replica's
    share of the global token-mean loss (NaN on other stages, which see no loss).
    """

    rank: int
    replica: int
    stage: int
    config: HybridConfig
    record: TrainRecord
    bytes_p2p: int                      # activations and gradients sent to neighbouring stages
    bytes_dp: int                       # gradients entering the dp group's all-reduce (0 when dp == 1)
    bytes_tied: int                     # tied-embedding gradient exchanged between first and last stage
    state_bytes: int                    # parameters + gradients + optimizer states held (from the tensors)
    num_parameters: int                 # trainable values on this stage (the head's copy included)
    peak_activations: int               # most micro-batches whose activations the stage held at once
    state: Optional[dict[str, Tensor]] = None
    events: list[Event] = field(default_factory=list)

    @property
    def step_times(self) -> list[float]:
        return self.record.step_times

    @property
    def tokens(self) -> list[int]:
        return self.record.tokens

    @property
    def losses(self) -> list[float]:
        """Loss shares per step on a last stage; empty elsewhere."""
        return self.record.losses if self.stage == self.config.pp - 1 else []


def summarize(results: Sequence[HybridResult], warmup: int = 1) -> dict[str, Any]:
    """The job's numbers from every rank's result: a step lasts as long as its slowest rank.

    Args:
        results: one :class:`HybridResult` per rank, in rank order (``launch``'s return value).
        warmup: first steps left out of the throughput.

    Returns:
        The layout, byte counts and peaks, and ``record``: the job's :class:`TrainRecord`
        (global loss, global tokens, slowest rank's seconds per step), whose throughput
        after ``warmup`` steps is ``tokens_per_sec``.
    """
    config = results[0].config
    last = [r for r in results if r.stage == config.pp - 1]
    record = TrainRecord.from_steps(
        losses=[sum(r.losses[k] for r in last) / config.dp for k in range(config.steps)],
        tokens=results[0].tokens,
        step_times=[max(r.step_times[k] for r in results) for k in range(config.steps)])
    return dict(layout=f"{config.dp} x {config.pp}", dp=config.dp, pp=config.pp, schedule=config.schedule,
                micro_batches=config.micro_batches, ranks=len(results), step_times=record.step_times,
                tokens_per_sec=record.throughput(skip=warmup), losses=record.losses, record=record,
                bytes_p2p=max(r.bytes_p2p for r in results), bytes_dp=max(r.bytes_dp for r in results),
                bytes_tied=max(r.bytes_tied for r in results), state_bytes=max(r.state_bytes for r in results),
                peak_activations=max(r.peak_activations for r in results))


def gather_state(results: Sequence[HybridResult], replica: int = 0) -> dict[str, Tensor]:
    """The parameters of one replica, stage by stage, by the unsplit model's names.

    Raises:
        ValueError: the runs did not return their state (``return_state=False``).
    """
    state: dict[str, Tensor] = {}
    for r in results:
        if r.replica == replica:
            if r.state is None:
                raise ValueError("results hold no parameters: run with HybridConfig(return_state=True)")
            state.update(r.state)
    return state


def compare_with_reference(results: Sequence[HybridResult], reference: dict[str, Tensor]) -> dict[str, float]:
    """Largest absolute difference per parameter between every replica and a reference ``state_dict``.

    The head's copy (``HEAD_COPY``) is compared with the reference's ``lm_head.weight``,
    which in the tied reference is the embedding itself.

    Raises:
        ValueError: a replica misses one of the reference's parameters, or results hold no state.
    """
    differences: dict[str, float] = {}
    for d in sorted({r.replica for r in results}):
        state = gather_state(results, d)
        for name, tensor in state.items():
            diff = max_abs_difference(tensor, reference[name].cpu())  # inf for a NaN: never a match
            differences[name] = max(differences.get(name, 0.0), diff)
    missing = [name for name in reference if name not in differences]
    if missing:
        raise ValueError(f"no stage holds the reference's parameters {missing}")
    return differences
