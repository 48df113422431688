"""Ring all-reduce written from point-to-point messages, and its cost model.

``dist.all_reduce`` is one call, so readers never see why its cost barely grows
with the number of ranks. Here the algorithm is spelled out: the tensor is cut
into ``world_size`` chunks and every rank talks only to its right-hand neighbour.

    reduce-scatter (N-1 steps): rank r sends chunk (r - s) % N, its neighbour adds it
    all-gather     (N-1 steps): rank r sends chunk (r + 1 - s) % N, its neighbour copies it

For N = 3 ranks, the chunk each rank *sends* at each step (rank r sends to r+1):

    step | phase          | rank 0 | rank 1 | rank 2
    -----+----------------+--------+--------+-------
      0  | reduce-scatter |   0    |   1    |   2
      1  | reduce-scatter |   2    |   0    |   1       -> rank r now owns summed chunk (r+1) % 3
      2  | all-gather     |   1    |   2    |   0
      3  | all-gather     |   0    |   1    |   2       -> every rank holds every summed chunk

The steps are pure data (:func:`ring_steps`): :func:`ring_all_reduce` executes
exactly that record, and the notebook's animation (``parallel_lib.viz.ring``)
replays it, so what readers watch is what the code does. Each rank sends
2(N-1)/N of the tensor, whatever N is, hence the cost model of :func:`allreduce_cost`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, Optional, Sequence

import torch
import torch.distributed as dist

from parallel_lib.common.checks import check_int
from parallel_lib.runtime.device import rank_device

__all__ = [
    "Phase", "Transfer", "RingStep", "ring_chunks", "ring_steps", "replay_contributions",
    "require_process_group", "ring_all_reduce", "allreduce_cost", "algorithm_bandwidth", "bus_bandwidth",
    "fit_allreduce_cost",
]

Phase = Literal["reduce-scatter", "all-gather"]

# messages are cut into segments this large so that reducing one overlaps receiving the next
_SEGMENT_BYTES = 4 << 20


@dataclass(frozen=True)
class Transfer:
    """One message of one step: ``src`` sends elements ``[start, stop)`` (chunk ``chunk``) to ``dst``."""

    src: int
    dst: int
    chunk: int
    start: int
    stop: int


@dataclass(frozen=True)
class RingStep:
    """All messages sent at the same time; ``transfers[r]`` is the one rank r sends.

    Attributes:
        phase: "reduce-scatter" (the receiver adds the chunk) or "all-gather" (it copies it).
        index: step number within its phase, 0 .. world_size-2.
        transfers: one :class:`Transfer` per rank, in rank order.
    """

    phase: Phase
    index: int
    transfers: tuple[Transfer, ...]


def ring_chunks(world_size: int, numel: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each of the ``world_size`` chunks of a flat tensor.

    Sizes differ by at most one (the first ``numel % world_size`` chunks are one
    longer, as in ``torch.tensor_split``); chunks are empty when ``numel < world_size``.
    """
    check_int("world_size", world_size, minimum=1)
    check_int("numel", numel, minimum=0)
    base, extra = divmod(numel, world_size)
    bounds = [c * base + min(c, extra) for c in range(world_size + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def ring_steps(world_size: int, numel: int) -> list[RingStep]:
    """The step record of a ring all-reduce: 2(N-1) steps, one message per rank each.

    Args:
        world_size: number of ranks N in the ring.
        numel: number of elements of the (flattened) tensor.

    Returns:
        The reduce-scatter steps then the all-gather steps (empty for one rank).

    Raises:
        ValueError: ``world_size < 1`` or ``numel < 0``.
    """
    chunks = ring_chunks(world_size, numel)
    n = world_size
    steps = []
    for phase, first_chunk in (("reduce-scatter", 0), ("all-gather", 1)):
        for s in range(n - 1):
            transfers = []
            for r in range(n):
                c = (r + first_chunk - s) % n
                transfers.append(Transfer(src=r, dst=(r + 1) % n, chunk=c, start=chunks[c][0], stop=chunks[c][1]))
            steps.append(RingStep(phase=phase, index=s, transfers=tuple(transfers)))  # type: ignore[arg-type]
    return steps


def replay_contributions(world_size: int, steps: Sequence[RingStep]) -> list[list[frozenset[int]]]:
    """Which ranks' inputs each rank's copy of each chunk contains after ``steps``.

    ``state[r][c]`` starts as ``{r}``; a reduce-scatter message unions the sender's
    set into the receiver's, an all-gather message replaces it. After a complete
    record every entry is ``{0, ..., N-1}``: the record is a correct all-reduce.
    """
    check_int("world_size", world_size, minimum=1)
    state = [[frozenset({r}) for _ in range(world_size)] for r in range(world_size)]
    for step in steps:
        sent = [state[t.src][t.chunk] for t in step.transfers]  # all messages of a step leave together
        for t, payload in zip(step.transfers, sent):
            state[t.dst][t.chunk] = state[t.dst][t.chunk] | payload if step.phase == "reduce-scatter" else payload
    return state


def require_process_group(what: str) -> None:
    """Fail fast, naming ``what``, when no default process group exists (instead of a cryptic error)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{what} needs an initialised process group: call it inside "
                           "parallel_lib.runtime.launcher(fn, world_size) or after "
                           "torch.distributed.init_process_group(...)")


def _check_collective_input(tensor: object, name: str = "tensor") -> torch.Tensor:
    """Reject, on the calling rank, input that would otherwise leave its peers waiting in a recv."""
    require_process_group("ring_all_reduce")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous (it is sent as a flat buffer), got strides "
                         f"{tuple(tensor.stride())} for shape {tuple(tensor.shape)}; pass {name}.contiguous()")
    expected = rank_device()  # the CPU for gloo, this rank's GPU for NCCL
    if tensor.device != expected:
        raise ValueError(f"{name} must be on this rank's device {expected} (backend {dist.get_backend()}), "
                         f"got {name}.device={tensor.device}; move it with {name}.to({str(expected)!r})")
    return tensor


def _segments(start: int, stop: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(a + size, stop)) for a in range(start, stop, size)]


_INBOXES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _inbox(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A receive buffer of at least ``numel`` elements, kept from call to call.

    A fresh 32 MB buffer per call costs the operating system thousands of page faults
    (new pages are mapped and zeroed on first touch), which made a 64 MB all-reduce
    about half again slower than gloo's own; keeping the largest one avoids that.
    """
    key = (dtype, device)
    if key not in _INBOXES or _INBOXES[key].numel() < numel:
        _INBOXES[key] = torch.empty(numel, dtype=dtype, device=device)
    return _INBOXES[key][:numel]


def ring_all_reduce(tensor: torch.Tensor, timeout: Optional[float] = None) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place, like ``dist.all_reduce(tensor)``, by ring messages only.

    Every rank executes the same :func:`ring_steps` record with ``isend``/``irecv``:
    each step it sends one chunk right and receives one from the left, then adds
    the received chunk (reduce-scatter) or keeps it (all-gather).

    Args:
        tensor: contiguous tensor on this rank's device (CPU for gloo, the current GPU for NCCL),
            same shape and dtype on every rank. Overwritten with the sum.
        timeout: seconds to wait for each step's messages; default: the process group's timeout.

    Returns:
        ``tensor`` itself, now holding the element-wise sum over ranks.

    Raises:
        RuntimeError: no initialised process group, or a step's messages did not arrive in time.
        TypeError: ``tensor`` is not a tensor.
        ValueError: ``tensor`` is not contiguous or not on this rank's device.
    """
    _check_collective_input(tensor)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    flat = tensor.view(-1)
    steps = ring_steps(world_size, flat.numel())
    if not steps:
        return tensor
    longest = max(stop - start for start, stop in ring_chunks(world_size, flat.numel()))
    inbox = _inbox(longest, flat.dtype, flat.device)  # reduce-scatter receives here, then adds
    segment = max(1, _SEGMENT_BYTES // flat.element_size())
    wait = {} if timeout is None else {"timeout": timedelta(seconds=timeout)}
    for step in steps:
        send = step.transfers[rank]
        recv = step.transfers[(rank - 1) % world_size]
        target = inbox[:recv.stop - recv.start] if step.phase == "reduce-scatter" else flat[recv.start:recv.stop]
        # cut into segments so that adding segment k overlaps with segment k+1 still arriving;
        # an empty chunk (numel < world_size) has no segments, for sender and receiver alike
        sends = [dist.isend(flat[a:b], dst=send.dst) for a, b in _segments(send.start, send.stop, segment)]
        recvs = [(dist.irecv(target[a - recv.start:b - recv.start], src=recv.src), a, b)
                 for a, b in _segments(recv.start, recv.stop, segment)]
        for work, a, b in recvs:
            work.wait(**wait)
            if step.phase == "reduce-scatter":
                flat[a:b].add_(target[a - recv.start:b - recv.start])
        for work in sends:
            work.wait(**wait)
    return tensor


def _check_cost_args(nbytes: float, world_size: int) -> None:
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got nbytes={nbytes!r}")
    check_int("world_size", world_size, minimum=1)


def allreduce_cost(nbytes: float, world_size: int, bandwidth: float, latency: float) -> float:
    """Seconds a ring all-reduce of ``nbytes`` takes: ``2(N-1)/N * S/B + 2(N-1) * alpha``.

    Each of the 2(N-1) steps pays the per-message latency and moves S/N bytes per link.

    Args:
        nbytes: message size S in bytes.
        world_size: number of ranks N.
        bandwidth: link bandwidth B in bytes per second.
        latency: per-message latency alpha in seconds.

    Raises:
        ValueError: negative size or latency, non-positive bandwidth, ``world_size < 1``.
    """
    _check_cost_args(nbytes, world_size)
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be > 0 bytes/s, got bandwidth={bandwidth!r}")
    if latency < 0:
        raise ValueError(f"latency must be >= 0 s, got latency={latency!r}")
    n = world_size
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


def algorithm_bandwidth(nbytes: float, seconds: float) -> float:
    """nccl-tests' "algbw": message size over time, in bytes per second."""
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got seconds={seconds!r}")
    return nbytes / seconds


def bus_bandwidth(algbw: float, world_size: int) -> float:
    """nccl-tests' "busbw" of an all-reduce: ``algbw * 2(N-1)/N``.

    The factor is the share of the message each link carries in a ring, so busbw
    can be compared with the hardware's link bandwidth whatever the number of ranks.
    """
    _check_cost_args(algbw, world_size)
    return algbw * 2 * (world_size - 1) / world_size


def fit_allreduce_cost(nbytes: Sequence[float], seconds: Sequence[float], world_size: int) -> tuple[float, float]:
    """Least-squares ``(bandwidth, latency)`` of :func:`allreduce_cost` for measured times.

    The model is linear in S, ``t = a * S + b``, so ``B = 2(N-1)/N / a`` and ``alpha = b / 2(N-1)``.

    Raises:
        ValueError: fewer than two distinct sizes, ``world_size < 2``, or a fit with no positive slope.
    """
    check_int("world_size", world_size, minimum=2)
    if len(nbytes) != len(seconds) or len(set(nbytes)) < 2:
        raise ValueError(f"need matching sizes and times with >= 2 distinct sizes, got {len(nbytes)} sizes "
                         f"({len(set(nbytes))} distinct) and {len(seconds)} times")
    x = torch.tensor(nbytes, dtype=torch.float64)
    y = torch.tensor(seconds, dtype=torch.float64)
    design = torch.stack([x, torch.ones_like(x)], dim=1)  # (n_points, 2)
    # weight each point by 1/t: relative errors, so small messages count as much as large ones
    slope, intercept = torch.linalg.lstsq(design / y[:, None], torch.ones_like(y)[:, None]).solution[:, 0].tolist()
    if slope <= 0:
        raise ValueError(f"times do not grow with size (slope {slope:.3g} s/byte); measure larger messages")
    n = world_size
    return 2 * (n - 1) / n / slope, max(intercept, 0.0) / (2 * (n - 1))
