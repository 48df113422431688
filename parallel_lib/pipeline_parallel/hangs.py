"""The hang gallery: schedules that look plausible and would hang, each rejected before it runs.

A pipeline that hangs on a cluster costs an allocation's worth of idle GPUs before a timeout
says anything, and says nothing about why. Every schedule here is refused by a check that runs
in microseconds on a laptop, with the reason:

- interleaved 1F1B with m < p (or m not a multiple of p): Megatron's order takes micro-batches in
  groups of p per model chunk, so a short group asks for micro-batches that do not exist;
- a receive order that does not match the send order: without tags, the k-th message on a
  channel is taken as the k-th one expected, so a rank computes on the wrong micro-batch or waits forever;
- a schedule that works with eager buffers and hangs without: 1F1B with every send posted on its own
  (NCCL's small messages are buffered; its large ones, and every blocking gloo send, wait until the
  receive is posted: :mod:`.live_deadlock` runs that hang for real on two gloo ranks);
- a V schedule whose ranks receive in the order they need: one channel carries activations and
  gradients, and the k-th tensor sent is taken for the k-th one wanted (the engine receives in
  the sender's order instead);
- two ranks that each wait for the other's output first (a dependency cycle).
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel_lib.pipeline_parallel.generators import check_interleaved_m, megatron_interleaved_order, zbv
from parallel_lib.pipeline_parallel.link import find_deadlock
from parallel_lib.pipeline_parallel.schedule import Action, Schedule, one_f_one_b
from parallel_lib.pipeline_parallel.simulator import validate_schedule

__all__ = ["check_blocking", "check_schedule", "Exhibit", "hang_gallery", "parse_schedule"]


def check_blocking(schedule: Schedule, paired: bool = True, sender_order: bool = True) -> None:
    """Refuse a schedule whose sends and receives would hang when every message blocks (NCCL's rule).

    ``paired`` and ``sender_order`` as for :func:`~parallel_lib.pipeline_parallel.link.exchange_plan`;
    the process engine exchanges with both on where this accepts the schedule, and in rounds
    (:func:`~parallel_lib.pipeline_parallel.link.round_plans`) where it does not.

    Raises:
        ValueError: naming where the ranks wait on each other, or the message matched with the wrong one.
    """
    verdict = find_deadlock(schedule, paired, sender_order)
    if verdict is not None:
        how = "batched send/recv" if paired else "one send or receive at a time"
        raise ValueError(f"schedule {schedule.name!r} hangs with blocking messages ({how}): {verdict}")


def check_schedule(schedule: Schedule, paired: bool = True, sender_order: bool = True) -> None:
    """Every check before a run: :func:`validate_schedule`, then :func:`check_blocking`."""
    validate_schedule(schedule)
    check_blocking(schedule, paired, sender_order)


def parse_schedule(name: str, *rows: str) -> Schedule:
    """A hand-written one-stage-per-rank schedule, one string per rank: ``"F0 F1 B0 W0 B1 W1"``."""
    stages = tuple(tuple(Action(word[0], int(word[1:])) for word in row.split()) for row in rows)  # type: ignore
    m = 1 + max(a.micro_batch for actions in stages for a in actions)
    return Schedule(name, len(rows), m, stages)


@dataclass(frozen=True)
class Exhibit:
    """One broken schedule: what it is, the schedule (None: refused before one exists), the reason."""

    title: str
    schedule: object
    reason: str


def _reason(check: object, *args: object) -> str:
    try:
        check(*args)  # type: ignore[operator]
    except ValueError as error:
        return str(error)
    raise AssertionError(f"{check} accepted {args}: the gallery's exhibit is not broken")


def hang_gallery() -> list[Exhibit]:
    """The broken schedules, each with the reason a check gives before anything runs."""
    short = megatron_interleaved_order(4, 2, 2)
    swapped = parse_schedule("swapped receives", "F0 F1 B0 B1", "F1 F0 B0 B1")  # even in sender order
    cycle = parse_schedule("waits for itself", "F0 B0 F1 B1", "F0 F1 B1 B0")
    eager = one_f_one_b(4, 8)
    v_shape = zbv(4, 8)
    return [
        Exhibit("interleaved 1F1B, p=4, m=2 (m < p): the generator refuses", None,
                _reason(check_interleaved_m, 4, 2)),
        Exhibit("... and Megatron's order built anyway: the validator refuses", short,
                _reason(check_schedule, short)),
        Exhibit("rank 1 receives micro-batch 1 before 0 (no tags)", swapped, _reason(check_schedule, swapped, True, False)),
        Exhibit("1F1B with unpaired sends: fine with eager buffers, hangs without", eager,
                _reason(check_schedule, eager, False)),
        Exhibit("ZBV receiving in the order it needs: activations and gradients cross on one channel", v_shape,
                _reason(check_schedule, v_shape, True, False)),
        Exhibit("each rank waits for the other (a dependency cycle)", cycle, _reason(check_schedule, cycle)),
    ]
