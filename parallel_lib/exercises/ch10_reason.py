"""Chapter 10's exercise on a layout and its reason, graded by the prediction the reason makes.

"Why this layout?" is answered by a neighbour that loses: one change away (the ZeRO stage one up or
down, or a factor 2 moved from one axis to another), it either does not fit or is slower. The
student chooses a layout for a 16-GPU budget and names such a neighbour with its predicted memory
per GPU and, when it fits, its step time. The checker prices both with
:func:`parallel_lib.planner.layout.price` (published A100 figures, the job's knobs fixed, so a
layout is its grid and ZeRO stage) and requires: the layout fits and is within 10 % of the fastest;
the neighbour is one change away; the predictions are within ``_TOLERANCE`` of the cost model's;
and the neighbour is indeed worse. Copying ``plan_layouts(...).best`` answers the first part only.

Wrong predictions are matched against the typical slips, each named: gigabytes for gibibytes, the
model state without the activations, one micro-batch's activations where the schedule keeps several,
the chosen layout's own figures; for the time, the compute without the data-parallel collectives
and the optimizer, the compute without the bubble, the chosen layout's own time.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

from parallel_lib.exercises._budget import SEQ, SHAPE, as_grid, calibration_and_cost, slower_hint
from parallel_lib.exercises._core import CheckResult, as_number, failed, passed
from parallel_lib.planner.layout import Layout, Priced, price

__all__ = ["REASON_STUB", "REASON_JOB", "SHAPE", "job_layout", "check_layout_reason"]

REASON_JOB = dict(devices=16, global_batch=64, max_tp=8)
SLACK = 1.10        # within 10 % of the fastest: as good as the model can tell
_TOLERANCE = 0.03   # a prediction within 3 % of the cost model's

REASON_STUB = '''\
# Budget: 16 A100 80 GB (2 nodes of 8, published figures), the Llama-style 8B model of exercise 1, 64
# sequences of 4096 tokens per step, bf16 mixed precision. Every layout here trains micro-batches of ONE
# sequence (64 // dp per replica), with 1F1B when pp > 1, sequence parallelism when tp > 1, no
# recomputation: job_layout(dp, tp, pp, zero) from parallel_lib.exercises.ch10_reason builds that Layout,
# and price(layout, SHAPE, 64, 4096, published_calibration("A100"), StepCost(0.0, GPUS["A100"].flops_bf16))
# prices it (SHAPE from parallel_lib.exercises.ch10_reason too).
# 1. Choose dp x tp x pp = 16 (tp within a node) and a ZeRO stage: it must fit in 80 GiB and be within
#    10 % of the fastest such layout.
# 2. Your reason, as a prediction: a neighbour you rejected, one change away (the ZeRO stage one up or down,
#    or a factor 2 moved from one axis to another), with its memory per GPU in GiB and, if it fits, its
#    step time in seconds (None if it does not fit). It must be worse than your choice.
LAYOUT_REASON = None  # your answer: dict(layout=dict(dp=, tp=, pp=, zero=), neighbour=dict(dp=, tp=, pp=, zero=),
#                       neighbour_gib=..., neighbour_seconds=...)
'''


def job_layout(dp: int, tp: int, pp: int, zero: int = 0) -> Layout:
    """The exercise's layout of a grid: micro-batches of one sequence, 1F1B, SP with tp, bf16.

    Raises:
        ValueError: a grid the job cannot split (see :class:`~parallel_lib.planner.layout.Layout`).
    """
    return Layout(dp=dp, tp=tp, pp=pp, zero=zero if dp > 1 else 0, sequence_parallel=tp > 1,
                  micro_batches=max(1, REASON_JOB["global_batch"] // dp), dtype="bf16")


@lru_cache(maxsize=64)
def _priced(dp: int, tp: int, pp: int, zero: int) -> Priced:
    calibration, cost, _ = calibration_and_cost()
    return price(job_layout(dp, tp, pp, zero), SHAPE, REASON_JOB["global_batch"], SEQ, calibration, cost)


def _fits(p: Priced) -> bool:
    return p.memory_bytes <= calibration_and_cost()[2]


@lru_cache(maxsize=1)
def _fastest() -> Priced:
    """The fastest layout of the job that fits, every grid with tp inside a node and every ZeRO stage."""
    n, found = REASON_JOB["devices"], []
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4, 8, 16):
            if n % (tp * pp):
                continue
            dp = n // (tp * pp)
            for zero in (0, 1, 2, 3) if dp > 1 else (0,):
                p = _priced(dp, tp, pp, zero)
                if _fits(p):
                    found.append(p)
    return min(found, key=lambda p: p.step_seconds)


def _is_neighbour(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> bool:
    """One change: the same grid and ZeRO one stage apart, or a factor 2 moved between two axes, ZeRO kept."""
    if a[:3] == b[:3]:
        return abs(a[3] - b[3]) == 1 and a[0] > 1
    ratios = sorted(y / x for x, y in zip(a[:3], b[:3]))
    return ratios == [0.5, 1.0, 2.0] and (a[3] == b[3] or 1 in (a[0], b[0]))


def _close(expected: float, got: float) -> bool:
    return math.isclose(got, expected, rel_tol=_TOLERANCE)


def _memory_slip(got: float, p: Priced, mine: Priced) -> str:
    """The named slip a wrong memory prediction (GiB) matches, or the hint that says what memory is made of."""
    slips = [(p.memory_bytes / 1e9, "that is the memory in GB (10^9 bytes); the answer is in GiB (2^30 bytes)"),
             ((p.state_bytes + p.working_bytes) / 2**30, "that is the neighbour's model state alone: the activations "
              "it keeps for the backward pass are missing"),
             (mine.memory_bytes / 2**30, "that is your own layout's memory, not the neighbour's")]
    if p.in_flight > 1:
        slips.append(((p.state_bytes + p.working_bytes + p.activation_bytes / p.in_flight) / 2**30,
                      "that counts one micro-batch's activations, but the first stage of a 1F1B pipeline holds "
                      "several micro-batches' at its peak"))
    for value, what in slips:
        if _close(value, got):
            return what
    return ("memory per GPU is the busiest rank's model state (over the ranks that shard it), what ZeRO-3 gathers "
            "while computing, and the activations of the micro-batches in flight")


def _time_slip(got: float, p: Priced, mine: Priced) -> str:
    slips = [(p.compute, "that is the neighbour's compute alone: the data-parallel collectives and the optimizer "
              "come after the backward pass"),
             (mine.step_seconds, "that is your own layout's step time, not the neighbour's")]
    if p.bubble > 0.02:
        slips.append((p.compute * (1 - p.bubble) + p.dp_comm + p.optimizer, "that leaves out the pipeline's bubble"))
    for value, what in slips:
        if abs(value - p.step_seconds) > _TOLERANCE * p.step_seconds and _close(value, got):
            return what
    return "a step is the schedule's compute (bubble and tensor-parallel collectives included), then the " \
           "data-parallel collectives the compute did not hide, then the optimizer"


def check_layout_reason(answer: Any) -> CheckResult:
    """The layout fits and is near the fastest; the neighbour is one change away, predicted right, and worse."""
    name = "layout_reason"
    if answer is None or answer is Ellipsis:
        return failed(name, None, "LAYOUT_REASON is not answered yet (it is still None)")
    keys = {"layout", "neighbour", "neighbour_gib", "neighbour_seconds"}
    if not isinstance(answer, dict) or set(answer) != keys:
        return failed(name, None, "LAYOUT_REASON must be a dict with the keys layout, neighbour, neighbour_gib and "
                      "neighbour_seconds", "a plan_layouts(...).best copied answers the layout only: the reason "
                      "is the neighbour and its prediction")
    try:
        mine, other = as_grid(answer["layout"]), as_grid(answer["neighbour"])
    except (TypeError, ValueError) as error:
        return failed(name, None, f"layout and neighbour must each be {error}")
    devices = REASON_JOB["devices"]
    if mine[0] * mine[1] * mine[2] != devices:
        return failed(name, "layout", f"dp·tp·pp = {mine[0] * mine[1] * mine[2]}, the budget is {devices} GPUs",
                      "use every GPU")
    if mine[1] > REASON_JOB["max_tp"]:
        return failed(name, "layout", f"tp = {mine[1]} spans more than one node of 8 GPUs",
                      "tensor parallelism's all-reduces are on the critical path: they must stay on NVLink")
    try:
        ours = _priced(*mine)
    except ValueError as error:
        return failed(name, "layout", f"the cost model cannot split the job that way: {error}")
    best = _fastest()
    if not _fits(ours):
        return failed(name, "layout", f"{ours.layout.name} does not fit: {ours.memory_bytes / 2**30:.1f} GiB per GPU",
                      "look at which term is over the card: model state calls for ZeRO or more tp/pp, activations "
                      "for more tp (sequence parallelism divides them)")
    ratio = ours.step_seconds / best.step_seconds
    if ratio > SLACK:
        return failed(name, "layout", f"{ours.layout.name} fits, but its step is predicted {ratio - 1:.0%} slower than "
                      "the fastest layout's", slower_hint(ours, best))
    if mine == other:
        return failed(name, "neighbour", "the neighbour is your layout itself",
                      "a reason compares your layout with one you rejected")
    if not _is_neighbour(mine, other):
        return failed(name, "neighbour", f"DP{other[0]}×TP{other[1]}×PP{other[2]} ZeRO-{other[3]} is more than one "
                      "change away from your layout",
                      "a neighbour changes one thing: the ZeRO stage by one, or a factor 2 from one axis to another")
    if other[0] * other[1] * other[2] != devices:
        return failed(name, "neighbour", "the neighbour must use the same 16 GPUs")
    try:
        theirs = _priced(*other)
    except ValueError as error:
        return failed(name, "neighbour", f"the cost model cannot split the job that way: {error}",
                      "choose a neighbour the model and the batch can be split into")
    try:
        gib = as_number(answer["neighbour_gib"])
    except TypeError as error:
        return failed(name, "neighbour_gib", f"neighbour_gib must be {error}")
    want_gib = theirs.memory_bytes / 2**30
    if not _close(want_gib, gib):
        return failed(name, "neighbour_gib", f"{gib:.4g} GiB is not within {_TOLERANCE:.0%} of the cost model's "
                      f"memory per GPU for {theirs.layout.name}", _memory_slip(gib, theirs, ours))
    seconds = answer["neighbour_seconds"]
    if not _fits(theirs):
        return passed(name, f"{ours.layout.name} ({ours.step_seconds:.3f} s per step, {ratio - 1:+.1%} against the "
                      f"fastest) beats {theirs.layout.name}, which needs {want_gib:.1f} GiB per GPU and does not fit")
    if seconds is None:
        return failed(name, "neighbour_seconds", f"the neighbour fits ({want_gib:.1f} GiB): predict its step time",
                      "a neighbour that fits is a reason only if it is slower")
    try:
        seconds = as_number(seconds)
    except TypeError as error:
        return failed(name, "neighbour_seconds", f"neighbour_seconds must be {error}")
    if not _close(theirs.step_seconds, seconds):
        return failed(name, "neighbour_seconds", f"{seconds:.4g} s is not within {_TOLERANCE:.0%} of the cost model's "
                      f"step time for {theirs.layout.name}", _time_slip(seconds, theirs, ours))
    if theirs.step_seconds <= ours.step_seconds:
        return failed(name, "neighbour", f"by your own prediction {theirs.layout.name} fits and is not slower "
                      f"({seconds:.3f} s against {ours.step_seconds:.3f} s): it is no reason against it",
                      "the reason for a choice is a neighbour that loses; find the one your layout beats")
    return passed(name, f"{ours.layout.name} ({ours.step_seconds:.3f} s per step, {ratio - 1:+.1%} against the "
                  f"fastest) beats {theirs.layout.name}: {theirs.step_seconds:.3f} s, "
                  f"{theirs.step_seconds / ours.step_seconds - 1:.0%} slower")
