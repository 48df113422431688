"""Where a step's time goes on one rank: data, compute, sync, optimizer, and the garbage collector.

Timing plots of training are never flat (chapter 01, section 7), and a spike is only useful
once it is attributed. :class:`StepPhases` splits each step of
:func:`~parallel_lib.training.run.train` into :data:`PHASES` and hands them to
:attr:`TrainRecord.phases <parallel_lib.common.training.TrainRecord.phases>`:

    data       the replica's rows of the global batch, moved to the device
    compute    the stage's forward and backward (a pipeline's exchanges included)
    sync       the dp axis's gradient reduction that backward did not hide, and the tied and
               sequence-parallel sums
    optimizer  the optimizer step (ZeRO-1/2: with its all-gather)
    gc         seconds Python's garbage collector ran during the step (it overlaps the others)

CUDA kernels run asynchronously, so a host clock alone would end "compute" when backward was
queued, and synchronising the device between phases would stall the host and hide the overlap
the step has. So the boundaries are stamps of the rank's
:class:`~parallel_lib.common.timeline.TimelineRecorder`: on a GPU, CUDA events on the stream that
computes, read once the step has ended (:meth:`StepPhases.read`); on a CPU, host clock readings.
A step's time is compute + sync + optimizer (its data phase is not part of it).
"""

from __future__ import annotations

import gc
import time
from typing import Any

from parallel_lib.common.timeline import Stamp, TimelineRecorder

__all__ = ["PHASES", "StepPhases"]

PHASES = ("data", "compute", "sync", "optimizer", "gc")


class _GCClock:
    """Seconds the garbage collector ran since the last ``take()`` (a ``gc.callbacks`` entry)."""

    def __init__(self) -> None:
        self.total, self._start = 0.0, 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._start

    def take(self) -> float:
        total, self.total = self.total, 0.0
        return total


class StepPhases:
    """Stamps of one rank's step boundaries, read after the step; a context that times the garbage collector.

    Use::

        with StepPhases(recorder) as phases:
            for batch in batches:
                phases.start()
                ...                     # data
                phases.mark()
                ...                     # compute, then phases.mark(); sync, mark(); optimizer, mark()
                seconds, by_phase = phases.read()

    Raises (:meth:`read`):
        RuntimeError: a step marked other than four times after :meth:`start`.
    """

    def __init__(self, recorder: TimelineRecorder) -> None:
        self.recorder = recorder
        self._stamps: list[Stamp] = []
        self._gc = _GCClock()

    def __enter__(self) -> StepPhases:
        gc.callbacks.append(self._gc)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._gc)

    def start(self) -> None:
        """The step begins (its data phase): no wait, a stamp."""
        self._stamps = [self.recorder.stamp()]
        self._gc.take()  # what the collector did between steps belongs to no step

    def mark(self) -> None:
        """The current phase ends and the next begins."""
        self._stamps.append(self.recorder.stamp())

    def read(self) -> tuple[float, dict[str, float]]:
        """``(the step's seconds, seconds by phase)``; on a GPU it waits for the step's last stamp only."""
        if len(self._stamps) != len(PHASES):
            raise RuntimeError(f"a step has {len(PHASES) - 1} phases to mark after start(), got "
                               f"{len(self._stamps) - 1} marks")
        t = [self.recorder.seconds(s) for s in self._stamps]
        split = [b - a for a, b in zip(t, t[1:])] + [self._gc.take()]
        return t[-1] - t[1], dict(zip(PHASES, split))
