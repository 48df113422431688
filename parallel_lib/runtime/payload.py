"""What travels between the caller and its ranks: the job in, return values out, both pickled.

A spawned rank starts a fresh interpreter and re-imports by name everything the job
refers to. A function, class, ``functools.partial`` target or config object defined in
a notebook cell lives in the kernel's ``__main__``, which a spawned process cannot
import, and the rank would die unpickling its arguments, before any of our code runs,
with the real ``AttributeError`` only on the terminal. So the caller pickles the job
itself (:func:`pack_job`), learning which ``__main__`` objects it refers to, and refuses
the job up front when ``__main__`` is a notebook; the rank unpickles it inside its own
error handling (:func:`unpack_job`), so any remaining failure reaches the caller.
"""

from __future__ import annotations

import io
import pickle
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["Job", "dumps", "pack_job", "unpack_job", "in_notebook"]


@dataclass(frozen=True)
class Job:
    """What every spawned rank needs to know."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    world_size: int
    backend: str
    host: str                # where the rendezvous store listens (its port is passed on its own)
    timeout: float           # seconds for the run, and the collectives' own timeout
    startup_timeout: float   # seconds to reach the store and join the group
    threads_per_rank: int | None
    # the caller's environment at launch: a rank forked from a fork server would otherwise see
    # the server's, frozen when it started (spawned ranks inherit the caller's as it is now)
    environment: tuple[tuple[str, str], ...] = ()


class _CPUPickler(pickle.Pickler):
    """Pickles GPU tensors as CPU tensors, so the caller never has to touch a GPU."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
            return obj.detach().cpu().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return NotImplemented


class _JobPickler(_CPUPickler):
    """Also records the ``__main__`` functions and classes the pickle refers to by name."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.main_names: list[str] = []

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType)) and getattr(obj, "__module__", None) == "__main__":
            name = f"__main__.{obj.__qualname__}"
            if name not in self.main_names:
                self.main_names.append(name)
        return super().reducer_override(obj)


def dumps(obj: Any) -> bytes:
    # plain pickle copies tensor data into the bytes; torch's multiprocessing pickler would
    # pass shared-memory handles that die with the rank's process
    buffer = io.BytesIO()
    _CPUPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def in_notebook() -> bool:
    """True in a Jupyter kernel or an interactive session: ``__main__`` has no file to re-import."""
    return not hasattr(sys.modules.get("__main__"), "__file__")


def pack_job(job: Job) -> tuple[bytes, list[str]]:
    """The pickled job and the ``__main__`` objects it names (ranks must re-import those).

    Raises:
        ValueError: the job cannot be pickled (a lambda, a nested function, an open file ...),
            or it refers to objects defined in a notebook cell, which ranks cannot import.
    """
    buffer = io.BytesIO()
    pickler = _JobPickler(buffer)
    try:
        pickler.dump(job)
    except Exception as e:  # lambdas, nested functions, bound methods of unpicklable objects
        raise ValueError(f"launch pickles fn and args into every rank, and this failed: {e}. fn must be a "
                         f"module-level function that spawned ranks can import (got fn={job.fn!r}), and args "
                         "must be picklable (no lambdas, open files or locks)") from None
    if pickler.main_names and in_notebook():
        raise ValueError(f"{cannot_travel(pickler.main_names)} is defined in a notebook cell or an interactive "
                         "session, which spawned ranks cannot import; move it into a module (a .py file, e.g. "
                         "in parallel_lib or next to the notebook) and import it from there")
    return buffer.getvalue(), pickler.main_names


def cannot_travel(main_names: list[str]) -> str:
    """``"__main__.Config"`` or ``"__main__.a, __main__.b"``: the objects that stay behind."""
    return ", ".join(repr(name) for name in main_names)


def unpack_job(payload: bytes) -> Job:
    """The job, unpickled in the rank (imports ``fn``'s module and those of the arguments)."""
    return pickle.loads(payload)
