"""Timelines: who computed what, when — one event format for every chapter.

Model parallelism (ch. 03), the pipeline executor and its simulator (ch. 04) and
data-parallel ranks all describe their work as a list of :class:`Event`. One plot
function (:func:`parallel_lib.viz.timeline.plot_timeline`) draws any of them, so a
measured run and a simulated schedule can be put side by side and compared by eye,
and the numbers read off a timeline (overlap, idle "bubble") are computed the same
way for both.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import torch

__all__ = ["Event", "TimelineRecorder", "Stamp", "synchronize_devices", "DeviceClock", "lanes", "makespan", "busy_time",
           "max_concurrency", "idle_fraction"]

KINDS = ("forward", "backward", "comm", "prefill", "decode")  # the last two: serving (ch. 09)


@dataclass(frozen=True)
class Event:
    """One interval of work on one lane.

    Attributes:
        lane: where the work ran: a device ("cuda:1"), a stage ("stage 0") or a rank ("rank 1").
        kind: "forward", "backward" or "comm"; "prefill" or "decode" for a request being served.
        micro_batch: index of the micro-batch (pipeline) or step; None when not applicable.
        start: seconds since the recorder's zero.
        end: seconds since the recorder's zero, ``end >= start``.
        label: optional text drawn on the bar (e.g. the block's name).
    """

    lane: str
    kind: str
    micro_batch: Optional[int]
    start: float
    end: float
    label: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got kind={self.kind!r}")
        if self.end < self.start:
            raise ValueError(f"end must not precede start, got start={self.start} end={self.end}")

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class _CudaStamp:
    """A CUDA event recorded on ``device``'s current stream: a time known once the device gets there."""

    device: torch.device
    event: Any  # torch.cuda.Event(enable_timing=True)


Stamp = Union[float, _CudaStamp]  # what TimelineRecorder.stamp returns: seconds now, or a pending CUDA event


def _cuda_event(device: torch.device) -> _CudaStamp:
    """Record a timing event on ``device``'s current stream (where that device's kernels are queued)."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return _CudaStamp(device, event)


class TimelineRecorder:
    """Collects :class:`Event` objects from any number of threads.

    Times come from ``time.perf_counter`` relative to the moment the recorder was
    made (or last :meth:`reset`). ``synchronize`` is called before each time stamp:
    CUDA kernels run asynchronously, so without ``torch.cuda.synchronize`` a GPU
    timeline would show when work was queued, not when it ran.

    ``event_devices`` is the other way to time GPUs, the one that does not change what it
    measures: :meth:`stamp` on one of those devices records a CUDA event on the device's
    current stream instead of waiting for it, so each device runs as it would untimed and
    the events say when *that device* got to each point. Intervals stamped that way are
    kept pending until :meth:`resolve` (one synchronisation at the end) turns them into
    events. Each device's times count from a zero event recorded on it at :meth:`reset`,
    after every device was idle, plus the host time of that recording, so lanes of
    different GPUs share one time axis.
    """

    def __init__(self, synchronize: Optional[Callable[[], None]] = None,
                 event_devices: Iterable[torch.device] = ()) -> None:
        self._synchronize = synchronize
        self.event_devices = [d for d in dict.fromkeys(event_devices) if d.type == "cuda"]
        self._lock = threading.Lock()
        self.events: list[Event] = []
        self.reset()

    def reset(self) -> None:
        """Forget recorded events and restart the clock at zero (once the device is idle, if one was given)."""
        if self.event_devices:  # before the clock's own synchronisation: the zero is read right after it
            synchronize_devices(self.event_devices)
        if self._synchronize is not None:
            self._synchronize()
        with self._lock:
            self.events = []
            self._pending: list[tuple] = []
            self._zero: float = time.perf_counter()
            # per GPU: a zero event, and the host time it was recorded at; the devices are idle,
            # so it fires at once, and the offset puts every GPU's lane on the host's time axis
            self._zero_events = {d: (_cuda_event(d), time.perf_counter() - self._zero) for d in self.event_devices}

    def now(self) -> float:
        """Seconds since zero, after synchronising the device if one was given."""
        if self._synchronize is not None:
            self._synchronize()
        return time.perf_counter() - self._zero

    def stamp(self, device: Optional[torch.device] = None) -> Stamp:
        """A time stamp for work on ``device``: a CUDA event on its stream if it is one of
        ``event_devices``, else :meth:`now`."""
        if device is not None and device in self._zero_events:
            return _cuda_event(device)
        return self.now()

    def add(self, lane: str, kind: str, micro_batch: Optional[int], start: float, end: float, label: str = "") -> Event:
        """Append an event measured elsewhere (thread-safe) and return it."""
        event = Event(lane, kind, micro_batch, start, end, label)
        with self._lock:
            self.events.append(event)
        return event

    def add_stamped(self, lane: str, kind: str, micro_batch: Optional[int], start: Stamp, end: Stamp,
                    label: str = "") -> None:
        """Like :meth:`add` with two :meth:`stamp` results; CUDA ones wait for :meth:`resolve`."""
        if isinstance(start, float) and isinstance(end, float):
            self.add(lane, kind, micro_batch, start, end, label)
            return
        with self._lock:
            self._pending.append((lane, kind, micro_batch, start, end, label))

    def _seconds(self, stamp: Stamp) -> float:
        if isinstance(stamp, float):
            return stamp
        zero, offset = self._zero_events[stamp.device]
        return offset + zero.event.elapsed_time(stamp.event) / 1e3  # ms -> s

    def resolve(self) -> list[Event]:
        """Wait for the event devices, turn every pending interval into an :class:`Event`
        (appended to :attr:`events`, in start order) and return :attr:`events`."""
        synchronize_devices(self.event_devices)
        with self._lock:
            pending, self._pending = self._pending, []
        for lane, kind, micro_batch, start, end, label in pending:
            first, last = self._seconds(start), self._seconds(end)
            self.add(lane, kind, micro_batch, first, max(first, last), label)  # clamp sub-microsecond reorderings
        with self._lock:
            self.events.sort(key=lambda e: e.start)
        return self.events

    @contextmanager
    def record(self, lane: str, kind: str, micro_batch: Optional[int] = None, label: str = "") -> Iterator[None]:
        """Time the body of a ``with`` block as one event, also when it raises."""
        start = self.now()
        try:
            yield
        finally:
            self.add(lane, kind, micro_batch, start, self.now(), label)


def synchronize_devices(devices: Iterable[torch.device]) -> None:
    """Wait until every CUDA device among ``devices`` has run its queued kernels.

    A clock read without it times when GPU work was queued, not when it ran; CPU
    devices have nothing queued. Each device is waited on by name, since a bare
    ``torch.cuda.synchronize()`` waits for the current device only.
    """
    for device in dict.fromkeys(devices):
        if device.type == "cuda":
            torch.cuda.synchronize(device)


class DeviceClock:
    """A clock for timing device work: ``clock()`` is ``time.perf_counter()`` read after
    :func:`synchronize_devices` on the given devices.

    Every timer in the library reads one of these, built with the devices the timed code
    runs on and no others: a data-parallel rank's own GPU, a model's or a pipeline's stage
    devices. Waiting on every GPU of the machine would tie one rank's timings to the others'.

    Args:
        devices: the devices whose queued kernels a clock read waits for (CPUs are skipped).
    """

    def __init__(self, devices: Iterable[torch.device]) -> None:
        self.devices = list(dict.fromkeys(devices))

    def __call__(self) -> float:
        synchronize_devices(self.devices)
        return time.perf_counter()

    def __repr__(self) -> str:
        return f"DeviceClock({[str(d) for d in self.devices]})"


def lanes(events: Iterable[Event]) -> list[str]:
    """Lanes in order of first appearance."""
    return list(dict.fromkeys(e.lane for e in events))


def makespan(events: Iterable[Event]) -> float:
    """Time from the first start to the last end (0 for no events)."""
    events = list(events)
    if not events:
        return 0.0
    return max(e.end for e in events) - min(e.start for e in events)


def busy_time(events: Iterable[Event], lane: str) -> float:
    """Seconds during which ``lane`` was busy (overlapping events on one lane count once)."""
    intervals = sorted((e.start, e.end) for e in events if e.lane == lane)
    total, cur_start, cur_end = 0.0, None, None
    for start, end in intervals:
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start  # type: ignore[operator]
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start  # type: ignore[operator]
    return total


def max_concurrency(events: Iterable[Event], tolerance: float = 0.0) -> int:
    """Largest number of distinct lanes busy at the same instant.

    Args:
        tolerance: seconds trimmed from each end of every event before comparing, so
            that the hand-over between two lanes (one ends as the next starts, with
            clock jitter) is not counted as overlap.
    """
    points: list[tuple[float, int, str]] = []
    for e in events:
        start, end = e.start + tolerance, e.end - tolerance
        if end > start:
            points += [(start, 1, e.lane), (end, -1, e.lane)]
    points.sort(key=lambda p: (p[0], p[1]))  # ends before starts at equal times
    active: dict[str, int] = {}
    best = 0
    for _, delta, lane in points:
        active[lane] = active.get(lane, 0) + delta
        if active[lane] == 0:
            del active[lane]
        best = max(best, len(active))
    return best


def idle_fraction(events: Iterable[Event]) -> float:
    """Share of lane-time spent idle over the whole run: the measured "bubble".

    ``1 - sum(busy per lane) / (number of lanes * makespan)``; for an ideal GPipe
    schedule with equal stage costs this equals ``(p - 1) / (m + p - 1)``.
    """
    events = list(events)
    span = makespan(events)
    names = lanes(events)
    if span == 0 or not names:
        return 0.0
    return 1.0 - sum(busy_time(events, lane) for lane in names) / (len(names) * span)
