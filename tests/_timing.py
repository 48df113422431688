"""A recorder of clock reads and device synchronisations, for tests of the timers' structure.

On a CPU ``synchronize_devices`` has nothing to wait for, so a timer that forgot it
would still pass every equivalence test here and then time queued, not executed,
kernels on a GPU. These helpers replace ``synchronize_devices`` and the clock that
``parallel_lib.common.timeline`` reads by loggers, so a test can assert the order:
every clock read right after a synchronisation of exactly the timed devices.
"""

from __future__ import annotations

import time
import types
from typing import Any

import parallel_lib.common.timeline as timeline


def record_clock_reads(monkeypatch: Any, *modules: types.ModuleType) -> list[tuple]:
    """Log ``("sync", devices)`` per ``synchronize_devices`` call and ``("clock",)`` per clock read.

    Patches ``parallel_lib.common.timeline`` (``DeviceClock`` and ``TimelineRecorder`` read
    ``time.perf_counter`` there) and ``synchronize_devices`` in each of ``modules`` that
    imported it by name.
    """
    log: list[tuple] = []

    def synchronize_devices(devices: Any) -> None:  # a fake: CUDA devices in a test need not exist
        log.append(("sync", tuple(str(d) for d in devices)))

    def perf_counter() -> float:
        log.append(("clock",))
        return time.perf_counter()

    monkeypatch.setattr(timeline, "synchronize_devices", synchronize_devices)
    monkeypatch.setattr(timeline, "time", types.SimpleNamespace(perf_counter=perf_counter))
    for module in modules:
        monkeypatch.setattr(module, "synchronize_devices", synchronize_devices)
    return log


def assert_clock_reads_follow_syncs(log: list[tuple], devices: tuple[str, ...]) -> int:
    """Every clock read in ``log`` comes right after a synchronisation of exactly ``devices``; returns the reads."""
    reads = 0
    for i, entry in enumerate(log):
        if entry == ("clock",):
            assert i > 0 and log[i - 1] == ("sync", devices), (
                f"clock read {reads} is not right after synchronising {devices}: ... {log[max(0, i - 3):i + 1]}")
            reads += 1
    return reads
