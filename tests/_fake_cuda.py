"""Stand-ins for CUDA events and streams, so a CPU-only machine can test GPU timing code.

``install(monkeypatch)`` replaces ``torch.cuda.Event``, ``torch.cuda.current_stream``,
``torch.cuda.Stream``, ``torch.cuda.stream`` and ``torch.cuda.synchronize``; each fake event
remembers the stream (and so the device) it was recorded on and the host time of the
recording, and ``elapsed_time`` refuses two events of different devices, as CUDA does.
A device's current stream is its default stream ("default") unless a ``torch.cuda.stream(s)``
block on this thread makes it ``s``; ``torch.cuda.Stream(device)`` makes side streams
("side 0", "side 1", ...). ``FakeCuda.times`` may dictate the next recordings' times
(a list of seconds, consumed in order) to encode a schedule the code under test cannot produce on a CPU.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class FakeStream:
    device: torch.device
    name: str = "default"


@dataclass
class FakeCuda:
    events: list = field(default_factory=list)   # every recorded event, in order
    synchronized: list = field(default_factory=list)  # devices waited for, in order
    times: list = field(default_factory=list)  # host times for the next recordings, consumed in order
    streams: list = field(default_factory=list)  # side streams made, in order
    event_waits: list = field(default_factory=list)  # events the host waited for, in order

    def recorded_on(self, device: str) -> list:
        return [e for e in self.events if str(e.stream.device) == device]

    def on_stream(self, name: str) -> list:
        """Events recorded on streams called ``name`` ("default", "side 0", ...)."""
        return [e for e in self.events if e.stream.name == name]


def install(monkeypatch) -> FakeCuda:
    log = FakeCuda()
    local = threading.local()  # per thread, as CUDA's current stream: {device: stream}

    class FakeEvent:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing, "a timing event needs enable_timing=True"
            self.stream, self.at = None, None

        def record(self, stream: FakeStream) -> None:
            assert isinstance(stream, FakeStream), "record on the device's stream"
            self.stream, self.at = stream, log.times.pop(0) if log.times else time.perf_counter()
            log.events.append(self)

        def synchronize(self) -> None:
            assert self.stream is not None, "wait for a recorded event"
            log.event_waits.append(self)

        def elapsed_time(self, end: "FakeEvent") -> float:
            assert self.stream is not None and end.stream is not None, "both events must be recorded"
            assert self.stream.device == end.stream.device, "CUDA compares events of one device only"
            return (end.at - self.at) * 1e3  # milliseconds, like CUDA

    def current_stream(device=None) -> FakeStream:
        device = torch.device(device)
        return getattr(local, "streams", {}).get(device, FakeStream(device))

    def new_stream(device=None, priority: int = 0) -> FakeStream:
        stream = FakeStream(torch.device(device), f"side {len(log.streams)}")
        log.streams.append(stream)
        return stream

    @contextmanager
    def stream(s: FakeStream):
        streams = getattr(local, "streams", {})
        local.streams = {**streams, s.device: s}
        try:
            yield
        finally:
            local.streams = streams

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "Stream", new_stream)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.synchronized.append(str(device)))
    return log
