"""Timelines: who computed what, when — one event format for every chapter.

Model parallelism (ch. 03), the pipeline executor and its simulator (ch. 04) and
data-parallel ranks all describe their work as a list of :class:`Event`. One plot
function (:func:`parallel_lib.viz.timeline.plot_timeline`) draws any of them, so a
measured run and a simulated schedule can be put side by side and compared by eye,
and the numbers read off a timeline (overlap, idle "bubble") are computed the same
way for both.

**Timing a GPU without changing what it does.** A CUDA call returns once its kernel is
queued, so the host clock alone dates the queueing, not the work. Reading it after
``torch.cuda.synchronize`` would date the work but also stop the host until the device
is idle, so the next operation is queued late: a prefetched all-gather then looks
serial, every bucket's all-reduce "ends" after backward and pipeline stages run in
lockstep. The timeline would erase the overlap it is there to show. So on a CUDA device
(one :class:`TimelineRecorder` was built with) a stamp is a CUDA event recorded on the
stream that does the work, and the events are read only after the step:

- compute: an event on the device's current stream, where PyTorch queues the kernels,
  before and after the work.
- a collective issued with ``async_op=True`` (:meth:`TimelineRecorder.stamp_done`):
  NCCL runs it on a stream of its own, once the current stream has reached the call.
  Its start is an event on the current stream when it is issued: the collective cannot
  start earlier (it may start later, when the other ranks join; the bar includes that
  wait, as on a CPU). Its end is an event on a side stream of the recorder's that is
  made to wait for the collective (``work.wait()`` under that stream) and for nothing
  else, so it fires when the collective has finished. Not the current stream after the
  consumer's ``work.wait()``: that event would also wait for all the compute queued
  before it (every bucket would end after backward). Not the work's future either:
  NCCL completes it when the collective is queued. The side stream waits for the
  collectives in the order they were issued, so a collective that finished before an
  earlier-issued one shows that one's end (one communicator runs them in order anyway).
- a blocking collective (``async_op=False``): an event on the current stream after the
  call, which NCCL made that stream wait for.

Each GPU's times count from a zero event recorded on it by :meth:`TimelineRecorder.reset`,
with the device idle (one synchronisation, before the step), plus the host time of that
recording, so lanes of several GPUs and the host share one axis. :meth:`~TimelineRecorder.resolve`
(or reading :attr:`~TimelineRecorder.events`) synchronises once, after the step. No
stamp synchronises anything. On a CPU nothing is queued: stamps are host clock readings
(``time.perf_counter``), and threads that overlap show it as measured.
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
    """A CUDA event recorded on one of ``device``'s streams: a time known once the device gets there."""

    device: torch.device
    event: Any  # torch.cuda.Event(enable_timing=True)


Stamp = Union[float, _CudaStamp]  # what TimelineRecorder.stamp returns: seconds now, or a pending CUDA event


def _cuda_event(device: torch.device) -> _CudaStamp:
    """Record a timing event on ``device``'s current stream (inside ``torch.cuda.stream(s)``: on ``s``)."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return _CudaStamp(device, event)


class TimelineRecorder:
    """Collects :class:`Event` objects from any number of threads.

    On a CPU, times come from ``time.perf_counter`` relative to the moment the recorder
    was made (or last :meth:`reset`); ``synchronize``, if given, is called before each
    host time stamp (for a caller that times a device without events).

    On the CUDA devices among ``device`` and ``event_devices``, :meth:`stamp` records a
    CUDA event on the device's current stream instead (see the module docstring): each
    device runs as it would untimed, and intervals stamped that way stay pending until
    :meth:`resolve`, which reading :attr:`events` calls. A recorder of one rank is built
    with ``device=`` its device, and its callers stamp without naming one; a recorder of
    several devices (a pipeline's stages, a model-parallel model) is built with
    ``event_devices`` and stamped with the device that did the work.

    Args:
        synchronize: called before each host clock reading, and at :meth:`reset`.
        event_devices: devices timed by CUDA events (CPUs and repeats are dropped).
        device: the device :meth:`stamp`, :meth:`stamp_done` and :meth:`record` time when
            given none (a CUDA one is timed by events too); default: the host clock.
    """

    def __init__(self, synchronize: Optional[Callable[[], None]] = None,
                 event_devices: Iterable[torch.device] = (), device: Optional[torch.device] = None) -> None:
        self._synchronize = synchronize
        self.device = None if device is None else torch.device(device)
        devices = [torch.device(d) for d in event_devices] + ([self.device] if self.device is not None else [])
        self.event_devices = [d for d in dict.fromkeys(devices) if d.type == "cuda"]
        self._lock = threading.Lock()
        self._events: list[Event] = []
        self._side_streams: dict[torch.device, Any] = {}  # per GPU: where the ends of async collectives are stamped
        self.reset()

    @property
    def events(self) -> list[Event]:
        """The recorded events; pending CUDA intervals are resolved first (after the step)."""
        if self._pending:
            self.resolve()
        return self._events

    def reset(self) -> None:
        """Forget recorded events and restart the clock at zero (once the devices are idle).

        Call it before a step, not inside one: it synchronises the event devices.
        """
        if self.event_devices:  # before the clock's own synchronisation: the zero is read right after it
            synchronize_devices(self.event_devices)
        if self._synchronize is not None:
            self._synchronize()
        with self._lock:
            self._events = []
            self._pending: list[tuple] = []
            self._zero: float = time.perf_counter()
            # per GPU: a zero event, and the host time it was recorded at; the devices are idle,
            # so it fires at once, and the offset puts every GPU's lane on the host's time axis
            self._zero_events = {d: (_cuda_event(d), time.perf_counter() - self._zero) for d in self.event_devices}

    def now(self) -> float:
        """Seconds since zero on the host clock, after ``synchronize`` if one was given."""
        if self._synchronize is not None:
            self._synchronize()
        return time.perf_counter() - self._zero

    def _device(self, device: Optional[torch.device]) -> Optional[torch.device]:
        """``device`` (default: the recorder's own), once checked: a GPU must be timed by events."""
        device = self.device if device is None else torch.device(device)
        if device is not None and device.type == "cuda" and device not in self._zero_events:
            raise ValueError(f"device={device} is not timed by this recorder: its clock would date when kernels "
                             f"were queued, not when they ran; build it with event_devices=[...{device}...] "
                             f"(it has {[str(d) for d in self.event_devices]})")
        return device

    def stamp(self, device: Optional[torch.device] = None) -> Stamp:
        """A time stamp for work on ``device`` (default: the recorder's own).

        Returns:
            A CUDA event on the device's current stream for a GPU; :meth:`now` otherwise.

        Raises:
            ValueError: a CUDA device the recorder was not built with.
        """
        device = self._device(device)
        if device is not None and device.type == "cuda":
            return _cuda_event(device)
        return self.now()

    def stamp_done(self, work: Any, device: Optional[torch.device] = None) -> Optional[Stamp]:
        """The end of the asynchronous collective ``work`` on ``device``, stamped without waiting for it.

        Call it right after issuing the collective. On a GPU the stamp is a CUDA event on
        the recorder's side stream for the device, made to wait (``work.wait()`` under
        that stream) for the collective only; the host does not wait (unless
        ``TORCH_NCCL_BLOCKING_WAIT`` is set), and neither does the compute stream: the
        consumer still calls ``work.wait()`` itself, and keeps the collective's tensors alive
        until then (NCCL may stop guarding them for the allocator at the first ``wait``).

        Returns:
            That stamp; None where only the host clock dates it (a CPU, or ``work`` None
            for a blocking collective): the caller stamps the end once it has waited.

        Raises:
            ValueError: a CUDA device the recorder was not built with.
        """
        device = self._device(device)
        if work is None or device is None or device.type != "cuda":
            return None
        with self._lock:
            if device not in self._side_streams:
                self._side_streams[device] = torch.cuda.Stream(device)
            stream = self._side_streams[device]
        with torch.cuda.stream(stream):
            work.wait()  # no timeout: NCCL then only makes this stream wait, the host goes on
            return _cuda_event(device)

    def add(self, lane: str, kind: str, micro_batch: Optional[int], start: float, end: float, label: str = "") -> Event:
        """Append an event measured elsewhere (thread-safe) and return it."""
        event = Event(lane, kind, micro_batch, start, end, label)
        with self._lock:
            self._events.append(event)
        return event

    def add_stamped(self, lane: str, kind: str, micro_batch: Optional[int], start: Stamp, end: Stamp,
                    label: str = "") -> None:
        """Like :meth:`add` with two :meth:`stamp` results; CUDA ones wait for :meth:`resolve`."""
        if isinstance(start, float) and isinstance(end, float):
            self.add(lane, kind, micro_batch, start, end, label)
            return
        with self._lock:
            self._pending.append((lane, kind, micro_batch, start, end, label))

    def seconds(self, stamp: Stamp) -> float:
        """Seconds since zero of a :meth:`stamp`; for a CUDA one, once the device has got there.

        Waits for that one event only (not the device): call it after the step, when the
        device has passed it, to read a duration without synchronising inside the step.
        """
        if not isinstance(stamp, float):
            stamp.event.synchronize()
        return self._seconds(stamp)

    def _seconds(self, stamp: Stamp) -> float:
        if isinstance(stamp, float):
            return stamp
        zero, offset = self._zero_events[stamp.device]
        return offset + zero.event.elapsed_time(stamp.event) / 1e3  # ms -> s

    def resolve(self) -> list[Event]:
        """Wait for the event devices, turn every pending interval into an :class:`Event`
        (appended to :attr:`events`, in start order) and return :attr:`events`.

        Call it after the step: it synchronises the event devices."""
        synchronize_devices(self.event_devices)
        with self._lock:
            pending, self._pending = self._pending, []
        for lane, kind, micro_batch, start, end, label in pending:
            first, last = self._seconds(start), self._seconds(end)
            self.add(lane, kind, micro_batch, first, max(first, last), label)  # clamp sub-microsecond reorderings
        with self._lock:
            self._events.sort(key=lambda e: e.start)
        return self._events

    @contextmanager
    def record(self, lane: str, kind: str, micro_batch: Optional[int] = None, label: str = "") -> Iterator[None]:
        """Time the body of a ``with`` block on the recorder's device as one event, also when it raises."""
        start = self.stamp()
        try:
            yield
        finally:
            self.add_stamped(lane, kind, micro_batch, start, self.stamp(), label)


def synchronize_devices(devices: Iterable[torch.device]) -> None:
    """Wait until every CUDA device among ``devices`` has run its queued kernels.

    A clock read without it times when GPU work was queued, not when it ran; CPU
    devices have nothing queued. Each device is waited on by name, since a bare
    ``torch.cuda.synchronize()`` waits for the current device only. Used at the
    boundaries of a step (a recorder's reset and resolve, a step clock), never between
    the operations of one: that would serialise what the step overlaps.
    """
    for device in dict.fromkeys(devices):
        if device.type == "cuda":
            torch.cuda.synchronize(device)


class DeviceClock:
    """A clock for timing device work: ``clock()`` is ``time.perf_counter()`` read after
    :func:`synchronize_devices` on the given devices.

    Every step timer in the library reads one of these, built with the devices the timed code
    runs on and no others: a data-parallel rank's own GPU, a model's or a pipeline's stage
    devices. Waiting on every GPU of the machine would tie one rank's timings to the others'.
    A read synchronises, so it times whole steps; the operations inside a step are timed by
    a :class:`TimelineRecorder`'s CUDA events instead.

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
