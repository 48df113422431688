"""The calibration cache: one JSON file per machine, outside the repository, checked when it is read.

A calibration takes a minute or two, so ``load_or_calibrate`` measures once per machine
(:func:`~parallel_lib.planner.calibrate.machine_key`: host, torch version, threads per rank)
and keeps the result under ``$PARALLEL_LIB_CACHE`` or ``~/.cache/parallel_lib``. A file that
was truncated or edited is named, with the way out (delete it, or ``calibrate --refresh``);
the folder is checked for writing before anything is measured, so a result is never lost.
The file's name carries :data:`VERSION`, the calibration procedure's: a cache measured the old way
(version 1 timed collectives back to back; version 2 between pieces of compute,
:mod:`parallel_lib.planner.interleaved`; version 3 had no tensor-parallel pairs timed inside a step) is not
read, and the machine is measured again.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from parallel_lib.planner import calibrate as measure
from parallel_lib.planner.calibrate import Calibration, check_world_sizes, machine_key

__all__ = ["VERSION", "cache_path", "load_calibration", "load_or_calibrate"]

VERSION = 4  # bump whenever the calibration measures differently: older caches are then measured again


def cache_path(key: Optional[str] = None) -> Path:
    """``$PARALLEL_LIB_CACHE`` or ``~/.cache/parallel_lib``, ``planner-v<VERSION>-<key>.json``: outside the
    repository."""
    root = Path(os.environ.get("PARALLEL_LIB_CACHE", Path.home() / ".cache" / "parallel_lib"))
    return root / f"planner-v{VERSION}-{key or machine_key()}.json"


def load_calibration(path: Path) -> Calibration:
    """The calibration cached in ``path``, checked (:meth:`Calibration.from_json`).

    Raises:
        ValueError: the file is not UTF-8, not JSON, or holds a missing key or a bad number; the message
            names the file and says to delete it or measure again with ``calibrate --refresh``.
    """
    try:
        return Calibration.from_json(Path(path).read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"the calibration cache {path} is damaged: {error}; delete it, or measure again with "
                         "`python -m parallel_lib.planner calibrate --refresh`") from None


def _check_writable(folder: Path) -> None:
    """Create ``folder`` and write a probe file there: before a measurement, so its result is never lost."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise OSError(f"cannot write the calibration cache in {folder} ({error.strerror or error}); nothing was "
                      "measured. Set PARALLEL_LIB_CACHE to a writable folder") from None


def load_or_calibrate(path: Optional[Path] = None, refresh: bool = False, **kwargs: object) -> Calibration:
    """The cached calibration of this machine, measured and saved first if there is none (or ``refresh``,
    or ``world_sizes`` it lacks).

    Raises:
        ValueError: bad ``world_sizes``, or a damaged cache (:func:`load_calibration`), before measuring.
        OSError: the cache's folder is not writable, before measuring.
    """
    path = path or cache_path()
    wanted = check_world_sizes(kwargs["world_sizes"]) if "world_sizes" in kwargs else ()
    if path.exists() and not refresh:
        cached = load_calibration(path)
        if all(n in cached.ranks for n in wanted):
            return cached
    _check_writable(path.parent)
    calibration = measure.calibrate(**kwargs)  # type: ignore[arg-type]  # looked up now: tests replace it
    path.write_text(calibration.to_json())
    return calibration
