"""The collective guard: the two NCCL rules, checked on every call, so that a CPU run catches a GPU hang.

No GPU runs the test suite, and gloo forgives what NCCL does not. Two mistakes pass every
CPU test and then crash or hang the first GPU run:

1. **a tensor on the wrong device**: NCCL moves CUDA tensors only, gloo (as this course uses
   it) CPU tensors. A calibration or a reference that builds its tensors on the CPU and hands
   them to a group the launch made with NCCL fails on a GPU node only;
2. **a bare point-to-point message**: ``dist.isend``/``irecv``/``send``/``recv`` issued on
   their own. NCCL matches a bare send against receives that the peer posted inside
   ``dist.batch_isend_irecv`` unreliably, and two neighbours that both send first wait for
   each other (NCCL holds a large send until its receive is posted): a hang, where gloo
   buffers the send and finishes. The course's rule is that every exchange is ONE
   ``batch_isend_irecv`` holding its sends and its receives.

Under :func:`collective_guard`, each ``torch.distributed`` collective and point-to-point
call checks both rules first and raises :class:`CollectiveGuardError` naming the call, the
tensor's device and the group's backend. The test suite turns it on for every test and,
through the ``PARALLEL_LIB_GUARD=1`` environment variable, in every rank that ``launch`` or
``run_torchrun`` starts (:func:`guard_from_environment`).

The functions of ``torch.distributed`` are replaced once, on first use, by checking stand-ins
that pass straight through while no guard is on (a name bound earlier with
``from torch.distributed import all_reduce`` is not checked, nor are the functional collectives
DTensor issues: its ``DeviceMesh`` already ties them to one device type). Lesson code that shows
a bare send on gloo on purpose says so with :func:`allow_bare_p2p`; torch's own protocols (the
warm-up messages of ``torch.distributed.pipelining``) are torch's business and pass.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

__all__ = ["GUARD_ENV", "CollectiveGuardError", "collective_guard", "allow_bare_p2p", "guard_from_environment",
           "guard_active", "check_devices", "unwrap", "StandIn", "torch_ops", "install"]

GUARD_ENV = "PARALLEL_LIB_GUARD"  # "1": every rank started by launch/run_torchrun runs under the guard

# the device type each backend moves; a backend not listed here (mpi, ucc, a custom one) is not checked
_DEVICE_OF_BACKEND = {"nccl": "cuda", "gloo": "cpu"}

_COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
                "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all",
                "all_to_all_single", "gather", "scatter")
_POINT_TO_POINT = ("send", "recv", "isend", "irecv")


class CollectiveGuardError(RuntimeError):
    """A collective or point-to-point call that would crash or hang under NCCL."""


@dataclass(frozen=True, eq=False)  # each block removes its own frame, not an equal one
class _Frame:
    backend: Optional[str]  # pretend every group has this backend (tests of the NCCL rule on CPU); None: ask


_lock = threading.Lock()
_frames: list[_Frame] = []
_bare_p2p = threading.local()  # .depth: allow_bare_p2p blocks open in this thread
_originals: dict[str, Callable[..., Any]] = {}


def guard_active() -> bool:
    """Whether a guard is on in this process."""
    return bool(_frames)


@contextmanager
def collective_guard(backend: Optional[str] = None) -> Iterator[None]:
    """Check both NCCL rules (see the module docstring) on every ``torch.distributed`` call in the block.

    Args:
        backend: None asks each call's group (``dist.get_backend(group)``); "nccl" or "gloo"
            makes every group look like that backend, so the NCCL rule can be tested on a CPU.

    Raises:
        ValueError: ``backend`` is not None, "nccl" or "gloo".
        CollectiveGuardError: in the block, a call breaks a rule.
    """
    if backend is not None and backend not in _DEVICE_OF_BACKEND:
        raise ValueError(f"backend must be None (ask each group), 'nccl' or 'gloo', got backend={backend!r}")
    install()
    frame = _Frame(backend)
    with _lock:
        _frames.append(frame)
    try:
        yield
    finally:
        with _lock:
            _frames.remove(frame)


def guard_from_environment() -> bool:
    """Turn the guard on for the rest of this process if ``PARALLEL_LIB_GUARD=1``; return whether it is on.

    Called by every rank ``launch`` or ``run_torchrun`` starts, so a test run's ranks are guarded too.
    """
    if os.environ.get(GUARD_ENV) == "1" and not guard_active():
        install()
        with _lock:
            _frames.append(_Frame(None))  # never removed: the rank's process ends with its job
    return guard_active()


@contextmanager
def allow_bare_p2p() -> Iterator[None]:
    """Allow bare ``send``/``recv``/``isend``/``irecv`` in this thread for the block.

    Only for lesson code that shows them on gloo, which buffers sends: on NCCL, pair every
    send with its receive in one ``dist.batch_isend_irecv``.
    """
    _bare_p2p.depth = getattr(_bare_p2p, "depth", 0) + 1
    try:
        yield
    finally:
        _bare_p2p.depth -= 1


def check_devices(call: str, tensors: list[torch.Tensor], backend: str) -> None:
    """Raise if a tensor of ``call`` is not on the device type ``backend`` moves.

    ``backend`` is what ``dist.get_backend`` answers: "nccl", "gloo", or a mapping such as
    "cpu:gloo,cuda:nccl" (a group with a backend per device type).

    Raises:
        CollectiveGuardError: naming the call, the tensor's device and the backend.
    """
    if ":" in backend:  # "cpu:gloo,cuda:nccl": each device type its own backend
        allowed = {part.split(":")[0] for part in backend.split(",")}
    elif backend in _DEVICE_OF_BACKEND:
        allowed = {_DEVICE_OF_BACKEND[backend]}
    else:
        return
    for tensor in tensors:
        if tensor.device.type not in allowed:
            wanted = " or ".join(sorted(allowed))
            raise CollectiveGuardError(
                f"dist.{call} got a tensor on {tensor.device}, but its group's backend is {backend}, which moves "
                f"{wanted} tensors only; create the tensor on the rank's device "
                "(parallel_lib.runtime.rank_device()) or use a group of the matching backend")


def _tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor in an argument: a tensor, or a (nested) list or tuple of them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _backend(group: Any) -> Optional[str]:
    """The backend the innermost guard assumes for ``group``; None when there is nothing to ask."""
    frames = list(_frames)
    if frames and frames[-1].backend is not None:
        return frames[-1].backend
    if not dist.is_available() or not dist.is_initialized():
        return None  # torch raises its own error for a call outside a process group
    try:
        return str(dist.get_backend(group))
    except (RuntimeError, ValueError):  # a group this rank is not part of: torch says so itself
        return None


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_STAND_INS = (os.path.join("parallel_lib", "runtime", "guard.py"), os.path.join("parallel_lib", "runtime",
                                                                                   "collectives.py"))


def _called_by_torch() -> bool:
    """Whether torch itself sent the message (past this guard's and the counter's stand-ins).

    torch's own protocols (``torch.distributed.pipelining``'s warm-up messages, for one) are
    torch's business; the guard checks the code that calls torch.
    """
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.endswith(_STAND_INS):  # this guard, the counter
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(_TORCH_DIR)


def unwrap(fn: Any) -> Any:
    """The ``torch.distributed`` function under any checking or counting stand-ins."""
    while not inspect.isfunction(fn) and getattr(fn, "__wrapped__", None) is not None:
        fn = fn.__wrapped__  # torch's own functions are plain functions (with a __wrapped__ of their own)
    return fn


class StandIn:
    """A stand-in for a ``torch.distributed`` function that compares equal to the function it wraps.

    So ``dist.P2POp(dist.isend, ...)`` built while stand-ins are installed passes torch's check
    that ``op`` is ``isend`` or ``irecv``. The guard's checking stand-ins and the counter's
    counting ones both derive from it.
    """

    __wrapped__: Callable[..., Any]

    def __eq__(self, other: object) -> bool:
        return other is self or unwrap(other) is unwrap(self)

    def __hash__(self) -> int:
        return hash(unwrap(self))


@contextmanager
def torch_ops(p2p_op_list: list) -> Iterator[None]:
    """Give every ``P2POp`` torch's own function while torch runs the batch, the stand-ins back after.

    torch tells sends from receives by identity (``op.op is isend``), which a stand-in fails.
    """
    wrapped = [op.op for op in p2p_op_list]
    for op in p2p_op_list:
        op.op = unwrap(op.op)
    try:
        yield
    finally:
        for op, fn in zip(p2p_op_list, wrapped):
            op.op = fn


class _Checked(StandIn):
    """A checking stand-in for a ``torch.distributed`` function.

    It compares equal to the function it wraps, so ``dist.P2POp(dist.isend, ...)`` passes
    torch's check that ``op`` is ``isend`` or ``irecv``.
    """

    def __init__(self, name: str, original: Callable[..., Any]) -> None:
        self.__name__, self.__wrapped__ = name, original
        self._group_index = list(inspect.signature(original).parameters).index("group")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _frames:
            if self.__name__ in _POINT_TO_POINT and not getattr(_bare_p2p, "depth", 0) and not _called_by_torch():
                raise CollectiveGuardError(
                    f"dist.{self.__name__} outside dist.batch_isend_irecv: NCCL matches a bare point-to-point "
                    "message against batched ones unreliably, and two ranks that both send first wait for each "
                    "other (a hang). Put every send and receive of an exchange into ONE "
                    "dist.batch_isend_irecv([dist.P2POp(dist.isend, ...), dist.P2POp(dist.irecv, ...)])")
            group = args[self._group_index] if len(args) > self._group_index else kwargs.get("group")
            backend = _backend(group)
            if backend is not None:
                check_devices(self.__name__, _tensors(list(args) + list(kwargs.values())), backend)
        return self.__wrapped__(*args, **kwargs)



def _checked_batch(p2p_op_list: list, *args: Any, **kwargs: Any) -> Any:
    """``batch_isend_irecv`` that checks its tensors' devices, then runs torch's own ops."""
    if _frames and p2p_op_list:
        backend = _backend(getattr(p2p_op_list[0], "group", None))
        if backend is not None:
            check_devices("batch_isend_irecv", [op.tensor for op in p2p_op_list], backend)
    with torch_ops(p2p_op_list):
        return _originals["batch_isend_irecv"](p2p_op_list, *args, **kwargs)


def install() -> None:
    """Replace the functions of ``torch.distributed`` by checking stand-ins, once per process."""
    with _lock:
        if _originals:
            return
        for name in _COLLECTIVES + _POINT_TO_POINT:
            if hasattr(dist, name):  # e.g. reduce_scatter_single, new in torch 2.10
                _originals[name] = getattr(dist, name)
                setattr(dist, name, _Checked(name, _originals[name]))
        _originals["batch_isend_irecv"] = dist.batch_isend_irecv
        dist.batch_isend_irecv = _checked_batch
