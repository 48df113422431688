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
2(N-1)/N of the tensor, whatever N is, hence the cost model of :func:`allreduce_cost`
(in :mod:`parallel_lib.data_parallel.ring_cost`, re-exported here).

The two phases are useful apart: :func:`ring_reduce_scatter` runs only the
reduce-scatter steps of the same record and :func:`ring_all_gather` only the
all-gather steps. ZeRO (chapter 06) is exactly that split: gradients are
reduce-scattered, each rank updates its shard, parameters are all-gathered.

Every step is ONE ``dist.batch_isend_irecv`` call holding that step's sends and
receives together. NCCL runs a send only once its peer has posted the matching
receive; posting all sends first (or pairing them by tags, which NCCL ignores)
can deadlock or serialise a ring on GPUs, while one batch per step lets NCCL pair
each rank's send with its neighbour's receive.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, Optional, Sequence

import torch
import torch.distributed as dist

from parallel_lib.common.checks import check_int
from parallel_lib.data_parallel.ring_cost import algorithm_bandwidth, allreduce_cost, bus_bandwidth, fit_allreduce_cost
from parallel_lib.runtime.device import rank_device

__all__ = ["Phase", "Transfer", "RingStep", "ring_chunks", "ring_steps", "replay_contributions",
           "require_process_group", "ring_all_reduce", "ring_reduce_scatter", "ring_all_gather",
           "allreduce_cost", "algorithm_bandwidth", "bus_bandwidth", "fit_allreduce_cost"]

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


def _check_collective_input(tensor: object, name: str = "tensor", what: str = "ring_all_reduce") -> torch.Tensor:
    """Reject, on the calling rank, input that would otherwise leave its peers waiting in a recv."""
    require_process_group(what)
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


def _segments(start: int, stop: int, size: int) -> list[tuple[int, int]]:  # [start, stop) in pieces of size
    return [(a, min(a + size, stop)) for a in range(start, stop, size)]


_INBOXES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _inbox(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A receive buffer of at least ``numel`` elements, kept from call to call (a fresh 32 MB one
    costs thousands of page faults: a 64 MB all-reduce was half again slower than gloo's without it)."""
    key = (dtype, device)
    if key not in _INBOXES or _INBOXES[key].numel() < numel:
        _INBOXES[key] = torch.empty(numel, dtype=dtype, device=device)
    return _INBOXES[key][:numel]


def _run_steps(flat: torch.Tensor, steps: Sequence[RingStep], bounds: Sequence[tuple[int, int]],
               timeout: Optional[float], group: Any = None) -> None:
    """Execute ``steps`` on ``flat`` in place; ring chunk ``c`` lives at ``flat[bounds[c][0]:bounds[c][1]]``.

    Each step is one ``batch_isend_irecv``: this rank's send to its right-hand neighbour
    and its receive from the left-hand one, cut into segments so that adding a received
    segment overlaps the next still arriving (gloo returns one work per segment; NCCL may
    return one work for the whole batch, then the adds wait for all of it). Ranks in ``steps``
    are ranks of ``group``; a message goes to the peer's global rank.
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    longest = max((stop - start for start, stop in bounds), default=0)
    inbox = _inbox(longest, flat.dtype, flat.device)  # reduce-scatter receives here, then adds
    segment = max(1, _SEGMENT_BYTES // flat.element_size())
    wait: dict[str, Any] = {} if timeout is None else {"timeout": timedelta(seconds=timeout)}
    for step in steps:
        send, recv = step.transfers[rank], step.transfers[(rank - 1) % world_size]
        (s0, s1), (r0, r1) = bounds[send.chunk], bounds[recv.chunk]
        reducing = step.phase == "reduce-scatter"
        target = inbox[:r1 - r0] if reducing else flat[r0:r1]
        # an empty chunk (numel < world_size) has no segments, for sender and receiver alike
        sent, received = _segments(s0, s1, segment), _segments(r0, r1, segment)
        dst, src = _global(group, send.dst), _global(group, recv.src)
        ops = ([dist.P2POp(dist.isend, flat[a:b], dst, group) for a, b in sent]
               + [dist.P2POp(dist.irecv, target[a - r0:b - r0], src, group) for a, b in received])
        if not ops:
            continue
        works = dist.batch_isend_irecv(ops)  # [1] one batch per step: sends and receives together
        if len(works) != len(ops):  # one work for the whole batch: wait for it, then add everything
            for work in works:
                work.wait(**wait)
            works = []
        for k, (a, b) in enumerate(received):  # [2] reduce (or keep) each segment as it lands
            if works:
                works[len(sent) + k].wait(**wait)
            if reducing:
                flat[a:b].add_(target[a - r0:b - r0])
        for work in works[:len(sent)]:  # [3] the sends have left (each work waited once: gloo hangs on a 2nd wait)
            work.wait(**wait)


def _global(group: Any, rank: int) -> int:
    """The global rank of ``group``'s rank ``rank`` (None: the whole world)."""
    return rank if group is None else dist.get_global_rank(group, rank)


def ring_all_reduce(tensor: torch.Tensor, timeout: Optional[float] = None, group: Any = None) -> torch.Tensor:
    """Sum ``tensor`` over the ranks of ``group`` in place, like ``dist.all_reduce(tensor, group=group)``,
    by ring messages only.

    Every rank executes the same :func:`ring_steps` record, one ``batch_isend_irecv``
    per step: it sends one chunk right and receives one from the left, then adds
    the received chunk (reduce-scatter) or keeps it (all-gather).

    Args:
        tensor: contiguous tensor on this rank's device (CPU for gloo, the current GPU for NCCL),
            same shape and dtype on every rank. Overwritten with the sum.
        timeout: seconds to wait for each step's messages; default: the process group's timeout.
        group: the ranks to sum over (a mesh axis's group, e.g. ``pm.group("dp")``); None: every rank.

    Returns:
        ``tensor`` itself, now holding the element-wise sum over ranks.

    Raises:
        RuntimeError: no initialised process group, or a step's messages did not arrive in time.
        TypeError, ValueError: ``tensor`` is not a tensor, not contiguous or not on this rank's device.
    """
    _check_collective_input(tensor)
    flat = tensor.view(-1)
    world_size = dist.get_world_size(group)
    _run_steps(flat, ring_steps(world_size, flat.numel()), ring_chunks(world_size, flat.numel()), timeout, group)
    return tensor


def _shard_input(output: object, input: object, what: str, full: str, group: Any
                 ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Check the (output, input) pair of a ring half; ``full`` names the unsharded one. Returns the shard size."""
    out = _check_collective_input(output, "output", what)
    inp = _check_collective_input(input, "input", what)
    world_size = dist.get_world_size(group)
    whole, part = (inp, out) if full == "input" else (out, inp)
    if out.dtype != inp.dtype or whole.numel() != part.numel() * world_size:
        raise ValueError(f"{what}: {full} must hold world_size={world_size} times the shard's elements in the "
                         f"same dtype, got input {tuple(inp.shape)} {inp.dtype} and output {tuple(out.shape)} "
                         f"{out.dtype}; pad the flat buffer to a multiple of the world size")
    return out.view(-1), inp.view(-1), part.numel()


def _rank_order_bounds(world_size: int, shard: int) -> list[tuple[int, int]]:
    """Ring chunk c lives at chunk (c-1) % N: rank r, which ends the reduce-scatter owning
    ring chunk (r+1) % N (module docstring), then owns chunk r, as with torch's collectives."""
    return [(((c - 1) % world_size) * shard, ((c - 1) % world_size + 1) * shard) for c in range(world_size)]


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, timeout: Optional[float] = None,
                        group: Any = None) -> torch.Tensor:
    """``output`` = chunk ``rank`` of the sum of ``input`` over ranks, by the ring's reduce-scatter phase only.

    Same contract as ``dist.reduce_scatter_tensor(output, input, group=group)``: ``input`` holds
    one equal chunk per rank of ``group`` (None: every rank) and is left unchanged; ``output``
    gets this rank's summed chunk.

    Raises:
        RuntimeError: no process group, or messages that did not arrive within ``timeout`` seconds.
        TypeError, ValueError: not tensors, not contiguous, not on this rank's device, or sizes that
            do not match (``input.numel() == world_size * output.numel()``).
    """
    out, inp, shard = _shard_input(output, input, "ring_reduce_scatter", "input", group)
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    work = inp.clone()  # the ring adds into its buffer; the caller's input stays as it was
    steps = [s for s in ring_steps(world_size, work.numel()) if s.phase == "reduce-scatter"]
    _run_steps(work, steps, _rank_order_bounds(world_size, shard), timeout, group)
    out.copy_(work[rank * shard:(rank + 1) * shard])
    return output


def ring_all_gather(output: torch.Tensor, input: torch.Tensor, timeout: Optional[float] = None,
                    group: Any = None) -> torch.Tensor:
    """``output`` = every rank's ``input`` in rank order, by the ring's all-gather phase only.

    Same contract as ``dist.all_gather_into_tensor(output, input, group=group)``.

    Raises:
        The same errors as :func:`ring_reduce_scatter` (here ``output`` is the unsharded tensor).
    """
    out, inp, shard = _shard_input(output, input, "ring_all_gather", "output", group)
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    out[rank * shard:(rank + 1) * shard].copy_(inp)
    steps = [s for s in ring_steps(world_size, out.numel()) if s.phase == "all-gather"]
    _run_steps(out, steps, _rank_order_bounds(world_size, shard), timeout, group)
    return output
