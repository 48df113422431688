"""Counting collectives: every chapter's traffic comes from this one counter.

Each chapter states a formula for the bytes its strategy moves (a ring all-reduce
sends ``2(N-1)/N · S`` per rank, ZeRO-3 about 1.5× data parallelism, tensor
parallelism two all-reduces per layer and pass, ...). :func:`count_collectives`
records the collectives a rank really issues, so a test or a notebook cell can put
the count beside the formula::

    with count_collectives() as counter:
        train_step(...)
    counter.calls_of("all_reduce"), counter.wire_bytes()

Who sees what (one counter, two sources):

- **collectives** (all-reduce, broadcast, reduce-scatter, all-gather, all-to-all, ...) are
  seen the way PyTorch's own ``torch.distributed.tensor.debug.CommDebugMode`` sees them: a
  dispatch mode that meets every ``c10d`` collective op, whether the caller wrote
  ``dist.all_reduce(...)``, bound the name earlier, or went through the functional
  collectives that DTensor (``redistribute``, ``parallelize_module``) issues, which no
  wrapper of ``torch.distributed``'s functions sees (nor what DDP issues from C++, such as
  the broadcasts of its bucket order). The ops counted are CommDebugMode's own list; this
  module adds the message size and the group, which CommDebugMode does not record, and it
  does not enter CommDebugMode itself, whose module tracker hooks every module of a model
  (slower, and it warns on Hugging Face's output classes). A dispatch mode is per thread:
  collectives issued by another thread are not seen;
- **point-to-point** messages (``send``, ``recv``, ``isend``, ``irecv``, and the ops of a
  ``batch_isend_irecv``) are not on CommDebugMode's list, so the functions of
  ``torch.distributed`` are wrapped for them while the block runs (code that calls
  ``dist.isend(...)`` is counted; a name bound earlier with ``from torch.distributed import
  isend`` is not).

Each call records:

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
from torch.utils._python_dispatch import TorchDispatchMode

try:  # torch >= 2.5
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.debug import _comm_mode as _comm_debug
except ImportError:  # torch 2.4
    from torch.distributed._tensor import DTensor  # type: ignore[no-redef]
    from torch.distributed._tensor.debug import CommDebugMode  # type: ignore[no-redef]
    from torch.distributed._tensor.debug import comm_mode as _comm_debug  # type: ignore[no-redef]

from parallel_lib.cost.alpha_beta import ring_wire_bytes
from parallel_lib.runtime.guard import install as install_guard
from parallel_lib.runtime.guard import StandIn, torch_ops

__all__ = ["CollectiveCall", "CollectiveCounter", "count_collectives", "ring_wire_bytes"]


@dataclass(frozen=True)
class CollectiveCall:
    """One collective or point-to-point call as this rank issued it."""

    kind: str          # "all_reduce", "reduce_scatter", "all_gather", "broadcast", "send", "recv", ...
    nbytes: int        # message size S (see the module docstring)
    group_size: int    # N, ranks taking part (2 for send/recv)
    wire_bytes: float  # bytes this rank sends under the ring algorithm
    ranks: tuple[int, ...] = ()  # global ranks of the group (empty: the default group)


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


def _bytes(value: Any) -> int:
    """Bytes of a tensor, or of every tensor in a (nested) list of them."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    return 0


def _group(group: Any) -> tuple[int, tuple[int, ...]]:
    if group is None or group is dist.group.WORLD:
        return dist.get_world_size(), ()
    return dist.get_world_size(group), tuple(dist.get_process_group_ranks(group))


_lock = threading.Lock()
_active: list[CollectiveCounter] = []
_originals: dict[str, Callable[..., Any]] = {}


def _record(kind: str, nbytes: int, group: Any, sends: bool = True,
            counters: Optional[list[CollectiveCounter]] = None) -> None:
    if kind in ("send", "recv"):
        size, ranks = 2, ()
    else:
        size, ranks = _group(group)
    call = CollectiveCall(kind, nbytes, size, ring_wire_bytes(kind, nbytes, size) if sends else 0.0, ranks)
    for counter in list(_active) if counters is None else counters:
        counter.calls.append(call)


# --- collectives: CommDebugMode's list of ops, seen by a dispatch mode -------------------------------

# the ops CommDebugMode counts: c10d's (what dist.all_reduce & co. issue) and the functional ones (DTensor's)
_COLLECTIVE_OPS = frozenset(_comm_debug.c10d_collective_ops) | frozenset(CommDebugMode().comm_registry)

# an op's name without its namespace and trailing "_" -> the counter's kind
_KINDS = {
    "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce", "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "_allgather_base": "all_gather", "allgather": "all_gather", "allgather_coalesced": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base": "reduce_scatter", "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "alltoall": "all_to_all", "alltoall_base": "all_to_all", "all_to_all_single": "all_to_all",
    "shard_dim_alltoall": "all_to_all", "broadcast": "broadcast", "gather": "gather", "scatter": "scatter",
    "reduce": "reduce",
}
# where the whole message is: the gathered output of an all-gather, the input of everything else
_OUTPUTS = ("output_tensor", "output_tensors", "output_lists", "outputs")
_INPUTS = ("input_tensor", "input_tensors", "input_list", "input", "inputs", "tensors", "self")


def _process_group(arguments: dict[str, Any]) -> Any:
    """The op's group: a c10d op carries the ProcessGroup, a functional one its name."""
    if "process_group" in arguments:
        return dist.ProcessGroup.unbox(arguments["process_group"])
    name = arguments.get("group_name")
    if isinstance(name, str):
        from torch.distributed.distributed_c10d import _resolve_process_group
        return _resolve_process_group(name)
    return name


def _call_of(func: Any, args: tuple, kwargs: dict) -> tuple[str, int, Any, bool]:
    """``(kind, message bytes, group, whether this rank sends)`` of one collective op."""
    arguments = {a.name: v for a, v in zip(func._schema.arguments, args)}
    arguments.update(kwargs)
    kind = _KINDS.get(func._overloadpacket.__name__.rstrip("_"), func._overloadpacket.__name__)
    group = _process_group(arguments)
    if kind == "all_gather" and "group_size" in arguments:  # functional: each rank's input, group_size times
        nbytes = _bytes(next(arguments[k] for k in _INPUTS if k in arguments)) * int(arguments["group_size"])
    else:
        names = _OUTPUTS if kind == "all_gather" else _INPUTS
        nbytes = _bytes(next((arguments[k] for k in names if k in arguments), None))
    sends = True
    if kind == "broadcast":  # charged to its source only; the root is a rank of the group
        root = arguments.get("root_rank", arguments.get("src"))
        sends = dist.get_rank(group) == root
    return kind, nbytes, group, sends


class _CollectiveMode(TorchDispatchMode):
    """Records each collective op of CommDebugMode's list into one counter, with its size and group.

    Like CommDebugMode, it lets DTensor turn its ops into local ops and functional
    collectives first (``NotImplemented``), and then sees those.
    """

    def __init__(self, counter: CollectiveCounter) -> None:
        super().__init__()
        self.supports_higher_order_operators = True
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(t is DTensor for t in types):
            return NotImplemented
        out = func(*args, **kwargs)
        if func._overloadpacket in _COLLECTIVE_OPS:
            kind, nbytes, group, sends = _call_of(func, args, kwargs)
            _record(kind, nbytes, group, sends, counters=[self.counter])
        return out


# --- point-to-point: not on CommDebugMode's list, so torch.distributed's functions are wrapped ---------

_P2P = {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv"}


class _Counted(StandIn):
    """A counting stand-in for ``dist.send``/``recv``/``isend``/``irecv``."""

    def __init__(self, name: str, original: Callable[..., Any]) -> None:
        self.__name__, self.kind, self.__wrapped__ = name, _P2P[name], original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tensor = args[0] if args else kwargs.get("tensor")
        _record(self.kind, _bytes(tensor), None)
        return self.__wrapped__(*args, **kwargs)


def _counted_batch(p2p_op_list: list, *args: Any, **kwargs: Any) -> Any:
    from torch.distributed.distributed_c10d import isend

    with torch_ops(p2p_op_list):
        for op in p2p_op_list:
            _record("send" if op.op is isend else "recv", _bytes(op.tensor), None)
        return _originals["batch_isend_irecv"](p2p_op_list, *args, **kwargs)


def _patch() -> None:
    install_guard()  # the guard's checking stand-ins stay beneath ours, whichever comes first
    for name in _P2P:
        _originals[name] = getattr(dist, name)
        setattr(dist, name, _Counted(name, _originals[name]))
    _originals["batch_isend_irecv"] = dist.batch_isend_irecv
    dist.batch_isend_irecv = _counted_batch


def _unpatch() -> None:
    for name, original in _originals.items():
        setattr(dist, name, original)
    _originals.clear()


@contextmanager
def count_collectives() -> Iterator[CollectiveCounter]:
    """Record every collective and send/recv this thread issues in the block (see the module docstring).

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
        with _CollectiveMode(counter):
            yield counter
    finally:
        with _lock:
            _active.remove(counter)
            if not _active:
                _unpatch()
