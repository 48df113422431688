"""Hunting a planted bug with the exactness proof: run the lab's layouts with the bug in, read which ones break.

The proof of chapters 05 and 10 says every layout of :func:`~parallel_lib.training.train` ends
where one process ends. :func:`hunt` plants one of :mod:`.bug_lab`'s bugs in two gloo ranks
and trains the seven layouts of :data:`LAB_LAYOUTS` there (one launch, a few seconds): data
parallel with ZeRO-0/1/3, tensor parallel with and without sequence parallelism, two pipelines,
with one or two micro-batches. Each layout is compared with the one single-process
:func:`~parallel_lib.training.reference` as ``tests/test_layouts.py`` compares it: the loss
of the step (relative 1e-5) and every parameter after it (1e-6). The table says, per layout,
whether it still equals one process, differs (and whether its first loss was already wrong,
which tells a wrong forward or loss from a wrong backward or sum), or crashed (and with what).

Which layouts break, and which do not, is the clue: a bug that only breaks layouts with tp > 1
lives where tensor parallelism runs; one that spares every layout with one micro-batch lives
where micro-batches are counted.
"""

from __future__ import annotations

import copy
import math
from contextlib import nullcontext
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional, Sequence, Union

import torch

from parallel_lib.exercises.bug_lab import BUGS, planted
from parallel_lib.runtime.launcher import launch
from parallel_lib.training import Plan, RunConfig, job_record, max_difference, reference
from parallel_lib.training.run import TrainResult, build_model, train

__all__ = ["LAB_RUN", "LAB_LAYOUTS", "LOSS_RTOL", "PARAMETER_ATOL", "layout_label", "LayoutOutcome", "Hunt",
           "judge_layout", "hunt", "hunt_many", "hunt_worker"]

# the tiny GPT-2 cut to 2 blocks (a pipeline of 2 stages still has a block each), one AdamW step with a large eps:
# the update then depends on the gradient's scale (tests/test_layouts.py says why)
LAB_RUN = RunConfig(n_layer=2, steps=1, eps=1e-3, lr=1e-2, timeout=30.0)
LAB_LAYOUTS: tuple[Plan, ...] = (
    Plan(dp=2), Plan(dp=2, zero=1, micro_batches=1), Plan(dp=2, zero=3),
    Plan(tp=2), Plan(tp=2, sequence_parallel=True),
    Plan(pp=2), Plan(pp=2, schedule="gpipe", micro_batches=1))
LOSS_RTOL, PARAMETER_ATOL = 1e-5, 1e-6  # tests/test_layouts.py's tolerances


def layout_label(plan: Plan) -> str:
    """The layout's name in the lab's tables and answers, e.g. ``"dp2 zero1, m=1"`` (m: micro-batches)."""
    return f"{plan.name}, m={plan.micro_batches}"


@dataclass(frozen=True)
class LayoutOutcome:
    """One layout of a hunt against one process.

    Attributes:
        label: :func:`layout_label` of the plan.
        status: "equal", "differs" or "crashed".
        first_loss_equal: whether the first step's loss equals one process's (None: crashed).
        difference: the largest parameter difference after the steps (nan: crashed).
        worst: the parameter that differs most ("" when crashed).
        error: the first rank's error, one line ("" unless crashed).
    """

    label: str
    plan: Plan
    status: str
    first_loss_equal: Optional[bool]
    difference: float
    worst: str
    error: str = ""


class Hunt(list):
    """The outcomes of one bug (or none) on every layout; prints as a table."""

    def __init__(self, bug: Optional[str], outcomes: Sequence[LayoutOutcome]) -> None:
        super().__init__(outcomes)
        self.bug = bug

    @property
    def broken(self) -> set[str]:
        """The labels of the layouts that do not equal one process (differ or crash)."""
        return {o.label for o in self if o.status != "equal"}

    def __repr__(self) -> str:
        title = f"bug {self.bug}" if self.bug else "no bug"
        width = max(len(o.label) for o in self) if self else 10
        lines = [f"{title}: {len(self)} layouts, each against one process after {LAB_RUN.steps} AdamW step",
                 f"{'layout':<{width}}  {'result':<8}  {'first loss':<10}  largest parameter difference"]
        for o in self:
            if o.status == "crashed":
                lines.append(f"{o.label:<{width}}  {'crashed':<8}  {'-':<10}  {o.error}")
                continue
            first = "equal" if o.first_loss_equal else "differs"
            lines.append(f"{o.label:<{width}}  {o.status:<8}  {first:<10}  {o.difference:.1e} ({o.worst})")
        return "\n".join(lines)

    __str__ = __repr__


@lru_cache(maxsize=2)
def _dense_model(run: RunConfig) -> Any:
    return build_model(run)


def _copied_model(run: RunConfig) -> Any:
    """The run's dense model, built once per rank and copied for each layout (building it is the slow part)."""
    return copy.deepcopy(_dense_model(run))


def _attempt(rank: int, world_size: int, plan: Plan, run: RunConfig) -> Union[TrainResult, str]:
    try:
        return train(rank, world_size, plan, run, builder=_copied_model)
    except Exception as error:  # noqa: BLE001 - a crash is one of the outcomes the lab reads
        lines = str(error).strip().splitlines() or [""]
        return f"{type(error).__name__}: {lines[-1][:160]}"


def hunt_worker(rank: int, world_size: int, bugs: Sequence[Optional[str]], layouts: Sequence[Plan],
                run: RunConfig) -> list[list[Union[TrainResult, str]]]:
    """A rank of a hunt: for each bug (None: none) plant it here, train every layout, unplant it.

    Returns:
        Per bug, per layout: this rank's :class:`~parallel_lib.training.TrainResult`, or the
        error it raised as one line.
    """
    out = []
    for bug in bugs:
        with planted(bug) if bug is not None else nullcontext():
            out.append([_attempt(rank, world_size, plan, run) for plan in layouts])
    return out


@lru_cache(maxsize=4)
def _reference(run: RunConfig) -> tuple[list[float], dict[str, torch.Tensor]]:
    return reference(run)


def judge_layout(plan: Plan, per_rank: Sequence[Union[TrainResult, str]], run: RunConfig = LAB_RUN) -> LayoutOutcome:
    """One layout's ranks against one process, as tests/test_layouts.py judges a layout.

    Args:
        plan: the layout.
        per_rank: every rank's :class:`~parallel_lib.training.TrainResult`, or the error a rank raised (one line).
        run: what the ranks trained (the reference trains the same).

    Returns:
        "crashed" if a rank raised; "equal" if the step's loss (relative :data:`LOSS_RTOL`) and every
        parameter (absolute :data:`PARAMETER_ATOL`) equal one process's; "differs" otherwise.
    """
    label = layout_label(plan)
    errors = [r for r in per_rank if isinstance(r, str)]
    if errors:
        return LayoutOutcome(label, plan, "crashed", None, math.nan, "", errors[0])
    losses, state = _reference(run)
    got = job_record(per_rank).losses
    same_losses = [math.isclose(a, b, rel_tol=LOSS_RTOL) for a, b in zip(got, losses)]
    differences = max_difference(per_rank, state)
    worst = max(differences, key=differences.__getitem__)
    equal = all(same_losses) and differences[worst] <= PARAMETER_ATOL
    return LayoutOutcome(label, plan, "equal" if equal else "differs", same_losses[0], differences[worst], worst)


def hunt_many(bugs: Sequence[Optional[str]], layouts: Sequence[Plan] = LAB_LAYOUTS, run: RunConfig = LAB_RUN,
              timeout: float = 600.0) -> dict[Optional[str], Hunt]:
    """Every bug of ``bugs`` (None: the library as it is) on every layout, in one launch of 2 ranks, in that order.

    The ranks plant each bug in turn and take it out again, so a None after the bugs also shows
    that planting left nothing behind.

    Raises:
        ValueError: an unknown bug, or a layout that is not for 2 ranks.
    """
    for bug in bugs:
        if bug is not None and bug not in BUGS:
            raise ValueError(f"bug must be one of {sorted(BUGS)} (or None), got bug={bug!r}")
    for plan in layouts:
        if plan.mesh.world_size != 2:
            raise ValueError(f"the lab's layouts run on 2 ranks, got {plan.name} on {plan.mesh.world_size}")
    per_rank = launch(hunt_worker, 2, list(bugs), list(layouts), run, timeout=timeout, startup_timeout=300,
                      threads_per_rank=1)
    out: dict[Optional[str], Hunt] = {}
    for b, bug in enumerate(bugs):
        out[bug] = Hunt(bug, [judge_layout(plan, [ranks[b][k] for ranks in per_rank], run)
                              for k, plan in enumerate(layouts)])
    return out


def hunt(bug: Optional[str] = None, layouts: Sequence[Plan] = LAB_LAYOUTS, run: RunConfig = LAB_RUN) -> Hunt:
    """Plant ``bug`` (an id of :data:`~parallel_lib.exercises.bug_lab.BUGS`; None: none) and run every layout.

    Returns:
        A :class:`Hunt`: per layout equal / differs / crashed; print it for the table, ``.broken``
        for the labels that do not equal one process.

    Raises:
        ValueError: an unknown bug.
        RankError: a rank died outright (a crash inside a layout is an outcome, not an error).
    """
    return hunt_many([bug], layouts, run)[bug]
