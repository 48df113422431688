"""Our schedules and ``torch.distributed.pipelining``'s, in each other's terms.

PyTorch writes a rank's order as actions ``"{stage}{type}{micro-batch}"``: ``F`` forward, ``I``
backward-input (our B of a split backward), ``W`` backward-weight, ``B`` a whole backward (our
B of an unsplit one). :func:`to_torch_actions` and :func:`from_torch_actions` convert; and
:func:`torch_order` asks PyTorch's schedule classes for the order they would run, without a
process group: they compute ``pipeline_order`` in their constructor from the stages' indices
and the group size, so stand-in stages that carry only those numbers are enough. That reaches
into PyTorch's private ``_PipelineStageBase`` (checked against torch 2.13); :func:`torch_order`
returns None with the reason when a version differs.
"""

from __future__ import annotations

import re
from typing import Any, Optional, Sequence

from parallel_lib.pipeline_parallel.schedule import Action, Schedule

__all__ = ["TORCH_NAMES", "to_torch_actions", "from_torch_actions", "torch_order", "compare_with_torch"]

TORCH_NAMES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
               "zb-h1": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
               "dualpipev": "ScheduleDualPipeV"}
_ACTION = re.compile(r"^(\d+)([FIWB])(\d+)$")


def to_torch_actions(schedule: Schedule) -> list[list[str]]:
    """Each rank's actions as PyTorch writes them, e.g. ``["0F0", "0F1", "0I0", "0W0", ...]``."""
    split = schedule.split_backward
    kind = {"F": "F", "B": "I" if split else "B", "W": "W"}
    return [[f"{schedule.stage_of(r, a)}{kind[a.kind]}{a.micro_batch}" for a in actions]
            for r, actions in enumerate(schedule.stages)]


def from_torch_actions(name: str, orders: Sequence[Sequence[Any]], m: int,
                       placement: Optional[Sequence[int]] = None) -> Schedule:
    """A :class:`Schedule` from PyTorch's per-rank orders (strings or its ``_Action``; None entries skipped).

    PyTorch's whole backward ``B`` is our B; in a schedule that splits other backwards (DualPipeV)
    it becomes B then W back to back. An overlapped ``F&B`` pair becomes its F then its backward.

    Raises:
        ValueError: an action that is not ``{stage}{F|I|W|B}{micro-batch}`` (PyTorch's
            communication actions are refused by name).
    """
    p = len(orders)
    texts = [[text for item in order for text in _flatten(item)] for order in orders]
    for r, order in enumerate(texts):
        bad = next((text for text in order if _ACTION.match(text) is None), None)
        if bad is not None:
            raise ValueError(f"rank {r}: action {bad!r} is not {{stage}}{{F|I|W|B}}{{micro-batch}}")
    # a schedule that splits some backwards (DualPipeV) runs a whole one as B then W at once
    split = any(_ACTION.match(text)[2] in "IW" for order in texts for text in order)  # type: ignore[index]
    ranks = []
    for order in texts:
        actions = []
        for text in order:
            match = _ACTION.match(text)
            s, kind, i = int(match[1]), match[2], int(match[3])  # type: ignore[index]
            actions.append(Action("F" if kind == "F" else "W" if kind == "W" else "B", i, s))
            if kind == "B" and split:
                actions.append(Action("W", i, s))
        ranks.append(tuple(actions))
    place = tuple(placement) if placement is not None else tuple(range(p))
    if place == tuple(range(p)):
        ranks = [tuple(Action(a.kind, a.micro_batch) for a in actions) for actions in ranks]
    return Schedule(name, p, m, tuple(ranks), place)


def _flatten(item: Any) -> list[str]:
    if item is None:
        return []
    subs = getattr(item, "sub_actions", None)
    if subs:  # DualPipeV's overlapped F and B: run one after the other
        return [text for sub in subs for text in _flatten(sub)]
    return [str(item)]


def torch_order(name: str, p: int, m: int, placement: Sequence[int]) -> tuple[Optional[list[list[Any]]], str]:
    """``(per-rank order, "")`` from PyTorch's schedule class for ``name``, or ``(None, why not)``."""
    try:
        import torch.distributed.pipelining.schedules as schedules
        from torch.distributed.pipelining.stage import _PipelineStageBase
    except ImportError as error:  # pragma: no cover - torch without pipelining
        return None, f"torch.distributed.pipelining is missing: {error}"

    class _Stand(_PipelineStageBase):  # only what a schedule's constructor reads
        def __init__(self, index: int, rank: int) -> None:
            self.stage_index, self.num_stages, self.group_rank, self.group_size = index, len(placement), rank, p
            self.submod, self.has_backward, self.dw_builder = None, True, None

        def _create_grad_recv_info(self, *args: Any, **kwargs: Any) -> Any: ...
        def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> Any: ...
        def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any: ...

        @property
        def is_first(self) -> bool:
            return self.stage_index == 0

        @property
        def is_last(self) -> bool:
            return self.stage_index == self.num_stages - 1

    try:
        cls = getattr(schedules, TORCH_NAMES[name])
        stages = [_Stand(s, 0) for s in range(len(placement)) if placement[s] == 0]
        if len(stages) == 1 and not hasattr(cls, "_calculate_single_rank_operations"):
            return None, f"{cls.__name__} runs one stage per rank without a stored order"
        order = cls(stages, n_microbatches=m).pipeline_order
        return [list(order[r]) for r in range(p)], ""
    except Exception as error:  # a version whose internals differ, or a size it refuses
        return None, f"{TORCH_NAMES.get(name, name)}: {type(error).__name__}: {error}"


def compare_with_torch(ours: Schedule, torch_name: Optional[str] = None) -> str:
    """"equal", or the first difference per rank between our order and PyTorch's for the same p, m."""
    name = torch_name or ours.name
    theirs, why = torch_order(name, ours.num_stages, ours.num_micro_batches, ours.placement)
    if theirs is None:
        return f"not compared: {why}"
    try:
        converted = from_torch_actions(name, theirs, ours.num_micro_batches, ours.placement)
    except ValueError as error:
        return f"not compared: {error}"
    notes = []
    for r, (a, b) in enumerate(zip(ours.stages, converted.stages)):
        if a != b:
            k = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            notes.append(f"rank {r} from action {k}: ours {' '.join(map(str, a[k:k + 4]))} … "
                         f"theirs {' '.join(map(str, b[k:k + 4]))} …")
    return "equal" if not notes else "; ".join(notes)
