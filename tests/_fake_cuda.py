"""Stand-ins for CUDA events and streams, so a CPU-only machine can test GPU timing code.

``install(monkeypatch)`` replaces ``torch.cuda.Event``, ``torch.cuda.current_stream`` and
``torch.cuda.synchronize``; each fake event remembers the stream (and so the device) it was
recorded on and the host time of the recording, and ``elapsed_time`` refuses two events of
different devices, as CUDA does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class FakeStream:
    device: torch.device


@dataclass
class FakeCuda:
    events: list = field(default_factory=list)   # every recorded event, in order
    synchronized: list = field(default_factory=list)  # devices waited for, in order

    def recorded_on(self, device: str) -> list:
        return [e for e in self.events if str(e.stream.device) == device]


def install(monkeypatch) -> FakeCuda:
    log = FakeCuda()

    class FakeEvent:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing, "a timing event needs enable_timing=True"
            self.stream, self.at = None, None

        def record(self, stream: FakeStream) -> None:
            assert isinstance(stream, FakeStream), "record on the device's stream"
            self.stream, self.at = stream, time.perf_counter()
            log.events.append(self)

        def elapsed_time(self, end: "FakeEvent") -> float:
            assert self.stream is not None and end.stream is not None, "both events must be recorded"
            assert self.stream.device == end.stream.device, "CUDA compares events of one device only"
            return (end.at - self.at) * 1e3  # milliseconds, like CUDA

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream(torch.device(device)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.synchronized.append(str(device)))
    return log
