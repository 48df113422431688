"""Counting collectives: every chapter's traffic comes from this one counter.

Each chapter states a formula for the bytes its strategy moves (a ring all-reduce
sends ``2(N-1)/N · S`` per rank, ZeRO-3 about 1.5× data parallelism, tensor
parallelism two all-reduces per layer and pass, ...). :func:`count_collectives`
records the collectives a rank really issues, so a test or a notebook cell can put
the count beside the formula::

    with count_collectives() as counter:
        train_step(...)
    counter.calls_of("all_reduce"), counter.wire_bytes()

While the block runs, the functions of ``torch.distributed`` are wrapped (code that
calls ``dist.all_reduce(...)`` is counted; a name bound earlier with
``from torch.distributed import all_reduce`` is not). Each call records:

- ``nbytes``, the collective's message size as nccl-tests report it: the tensor for
  all-reduce and broadcast, the whole (unsharded) tensor for reduce-scatter and
  all-gather, the message for send and recv;
- ``wire_bytes``, what this rank sends under the ring algorithm that NCCL and gloo use
  for large messages: ``2(N-1)/N · S`` for all-reduce, ``(N-1)/N · S`` for
  reduce-scatter and all-gather, ``S`` for a send, 0 for a receive; a broadcast is
  counted as ``S`` on its source and 0 on every other rank: the bytes the source puts
  into the group (a chain or tree relays them further, which is the library's business,
  not the caller's).
"""

from __future__ import annotations

import threading
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

__all__ = ["CollectiveCall", "CollectiveCounter", "count_collectives", "ring_wire_bytes"]


@dataclass(frozen=True)
class CollectiveCall:
    """One collective or point-to-point call as this rank issued it."""

    kind: str          # "all_reduce", "reduce_scatter", "all_gather", "broadcast", "send", "recv", ...
    nbytes: int        # message size S (see the module docstring)
    group_size: int    # N, ranks taking part (2 for send/recv)
    wire_bytes: float  # bytes this rank sends under the ring algorithm
    ranks: tuple[int, ...] = ()  # global ranks of the group (empty: the default group)


def ring_wire_bytes(kind: str, nbytes: float, group_size: int) -> float:
    """Bytes one rank sends for a collective of ``nbytes`` over ``group_size`` ranks (ring algorithm).

    For a broadcast this is the source's share; the counter records 0 on the other ranks.
    """
    n = group_size
    if kind == "all_reduce":
        return 2 * (n - 1) / n * nbytes
    if kind in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n * nbytes
    if kind in ("send", "broadcast"):
        return float(nbytes)
    return 0.0


@dataclass
class CollectiveCounter:
    """The calls recorded in one :func:`count_collectives` block, with totals per kind."""

    calls: list[CollectiveCall] = field(default_factory=list)

    def _of(self, kind: Optional[str]) -> list[CollectiveCall]:
        return [c for c in self.calls if kind is None or c.kind == kind]

    def calls_of(self, kind: Optional[str] = None) -> int:
        """Number of calls of ``kind`` (all kinds when None)."""
        return len(self._of(kind))

    def nbytes(self, kind: Optional[str] = None) -> int:
        """Summed message sizes of ``kind``."""
        return sum(c.nbytes for c in self._of(kind))

    def wire_bytes(self, kind: Optional[str] = None) -> float:
        """Summed bytes this rank sent for ``kind``."""
        return sum(c.wire_bytes for c in self._of(kind))

    def by_kind(self) -> dict[str, tuple[int, int]]:
        """``{kind: (calls, message bytes)}``, in the order kinds first appeared."""
        counts: Counter[str] = Counter(c.kind for c in self.calls)
        return {kind: (counts[kind], self.nbytes(kind)) for kind in dict.fromkeys(c.kind for c in self.calls)}


def _bytes(tensor: Any) -> int:
    return tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0


def _group(group: Any) -> tuple[int, tuple[int, ...]]:
    if group is None or group is dist.group.WORLD:
        return dist.get_world_size(), ()
    return dist.get_world_size(group), tuple(dist.get_process_group_ranks(group))


# name in torch.distributed -> (kind, how to find the message size and group from the call's arguments)
Extractor = Callable[[tuple, dict], tuple[int, Any]]


def _arg(args: tuple, kwargs: dict, index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs.get(name)


_WRAPPED: dict[str, tuple[str, Extractor]] = {
    "all_reduce": ("all_reduce", lambda a, k: (_bytes(_arg(a, k, 0, "tensor")), _arg(a, k, 2, "group"))),
    # a broadcast's bytes are charged to its source only (_is_source)
    "broadcast": ("broadcast", lambda a, k: (_bytes(_arg(a, k, 0, "tensor")), _arg(a, k, 2, "group"))),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a, k: (_bytes(_arg(a, k, 1, "input")), _arg(a, k, 3, "group"))),
    "reduce_scatter": ("reduce_scatter",
                       lambda a, k: (sum(map(_bytes, _arg(a, k, 1, "input_list") or [])), _arg(a, k, 3, "group"))),
    "reduce_scatter_single": ("reduce_scatter", lambda a, k: (_bytes(_arg(a, k, 1, "input")), _arg(a, k, 3, "group"))),
    "all_gather_single": ("all_gather", lambda a, k: (_bytes(_arg(a, k, 0, "output_tensor")), _arg(a, k, 2, "group"))),
    "all_gather_into_tensor": ("all_gather",
                               lambda a, k: (_bytes(_arg(a, k, 0, "output_tensor")), _arg(a, k, 2, "group"))),
    "all_gather": ("all_gather",
                   lambda a, k: (sum(map(_bytes, _arg(a, k, 0, "tensor_list") or [])), _arg(a, k, 2, "group"))),
    "all_to_all_single": ("all_to_all", lambda a, k: (_bytes(_arg(a, k, 1, "input")), _arg(a, k, 4, "group"))),
    "send": ("send", lambda a, k: (_bytes(_arg(a, k, 0, "tensor")), None)),
    "isend": ("send", lambda a, k: (_bytes(_arg(a, k, 0, "tensor")), None)),
    "recv": ("recv", lambda a, k: (_bytes(_arg(a, k, 0, "tensor")), None)),
    "irecv": ("recv", lambda a, k: (_bytes(_arg(a, k, 0, "tensor")), None)),
}

_lock = threading.Lock()
_active: list[CollectiveCounter] = []
_originals: dict[str, Callable[..., Any]] = {}


def _is_source(args: tuple, kwargs: dict) -> bool:
    """Whether this rank is a broadcast's source (``src`` is a global rank, ``group_src`` a group rank)."""
    if kwargs.get("group_src") is not None:
        return dist.get_rank(_arg(args, kwargs, 2, "group")) == kwargs["group_src"]
    return dist.get_rank() == _arg(args, kwargs, 1, "src")


def _record(kind: str, nbytes: int, group: Any, sends: bool = True) -> None:
    if kind in ("send", "recv"):
        size, ranks = 2, ()
    else:
        size, ranks = _group(group)
    call = CollectiveCall(kind, nbytes, size, ring_wire_bytes(kind, nbytes, size) if sends else 0.0, ranks)
    for counter in list(_active):
        counter.calls.append(call)


class _Counted:
    """A counting stand-in for a ``torch.distributed`` function.

    It compares equal to the function it wraps, so ``dist.P2POp(dist.isend, ...)`` built
    while counting passes torch's check that ``op`` is ``isend`` or ``irecv``.
    """

    def __init__(self, name: str, kind: str, extract: Extractor, original: Callable[..., Any]) -> None:
        self.__name__, self.kind, self.extract, self.__wrapped__ = name, kind, extract, original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not getattr(_inside_batch, "active", False):  # a batch counts its ops itself
            nbytes, group = self.extract(args, kwargs)
            _record(self.kind, nbytes, group, sends=self.kind != "broadcast" or _is_source(args, kwargs))
        return self.__wrapped__(*args, **kwargs)

    def __eq__(self, other: object) -> bool:
        return other is self or other is self.__wrapped__

    def __hash__(self) -> int:
        return hash(self.__wrapped__)


_inside_batch = threading.local()


def _original(fn: Any) -> Any:
    return fn.__wrapped__ if isinstance(fn, _Counted) else fn


def _counted_batch(p2p_op_list: list, *args: Any, **kwargs: Any) -> Any:
    wrapped = [op.op for op in p2p_op_list]
    for op in p2p_op_list:
        op.op = _original(op.op)  # torch tells sends from receives by identity (``op.op is isend``)
        _record("send" if op.op is _originals["isend"] else "recv", _bytes(op.tensor), None)
    _inside_batch.active = True
    try:
        return _originals["batch_isend_irecv"](p2p_op_list, *args, **kwargs)
    finally:
        _inside_batch.active = False
        for op, fn in zip(p2p_op_list, wrapped):
            op.op = fn


def _patch() -> None:
    for name, (kind, extract) in _WRAPPED.items():
        if not hasattr(dist, name):  # e.g. reduce_scatter_single, new in recent torch
            continue
        _originals[name] = getattr(dist, name)
        setattr(dist, name, _Counted(name, kind, extract, _originals[name]))
    _originals["batch_isend_irecv"] = dist.batch_isend_irecv
    dist.batch_isend_irecv = _counted_batch


def _unpatch() -> None:
    for name, original in _originals.items():
        setattr(dist, name, original)
    _originals.clear()


@contextmanager
def count_collectives() -> Iterator[CollectiveCounter]:
    """Record every ``torch.distributed`` collective and send/recv issued in the block.

    Counters may nest (each sees every call made while it is open). ``P2POp`` objects
    built for ``batch_isend_irecv`` must name ``dist.isend``/``dist.irecv``, which are
    wrapped while counting: the batch is counted op by op, the ops are not counted twice.
    """
    counter = CollectiveCounter()
    with _lock:
        if not _active:
            _patch()
        _active.append(counter)
    try:
        yield counter
    finally:
        with _lock:
            _active.remove(counter)
            if not _active:
                _unpatch()
