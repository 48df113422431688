"""Split a data set across ranks for data-parallel training.

The classic tutorial's ``DataPartitioner`` shuffles once with a fixed seed and gives part
``k`` the next ``int(sizes[k] * len(data))`` examples. That silently drops up to one
example per part when the length does not divide, never reshuffles between epochs, and
``partition_dataset`` changes the batch size behind the user's back. Here:

* **Every example lands in exactly one part.** Part ``k`` covers the shuffled positions
  ``[round(c[k-1] * n), round(c[k] * n))`` where ``c`` is the running sum of ``sizes``
  (halves round up, the last bound is ``n``), so the lengths always add up to ``n``;
  with equal sizes they differ by at most one. ``drop_last=True`` instead gives part ``k``
  exactly ``floor(sizes[k] * n)`` examples and leaves the rest out of this epoch.
* **One shuffle for all ranks, a new one per epoch.** The permutation is
  ``torch.randperm(n)`` from a generator seeded with ``seed + epoch`` (as in
  ``DistributedSampler``): every rank computes the same one without talking to the others,
  and ``set_epoch`` changes it.
* **``batch_size`` is the global batch.** Each of ``world_size`` ranks loads
  ``batch_size // world_size`` examples per step; a global batch that does not divide is
  an error, not a silent change.

Which examples rank ``r`` gets in step ``k`` (``partition_dataset``)::

    perm  = randperm(n, seed + epoch)            # the same on every rank
    part  = perm[start_r : end_r]                # the contiguous block above, world_size equal sizes
    part += part[: L - len(part)]                # pad to L = ceil(n / world_size) (drop_last=False)
    batch = part[k * b : (k + 1) * b]            # b = batch_size // world_size

Every rank thus has the same number of steps (data-parallel ranks must, or the gradient
all-reduce waits forever): without ``drop_last`` at most ``world_size - 1`` examples are
seen twice per epoch, exactly like ``DistributedSampler``'s padding; with it, at most
``world_size - 1`` are left out. The global batch ``k``, the one a single process would
train on, is the concatenation of every rank's batch ``k`` in rank order:
``global_batch_indices`` returns it.
"""

from __future__ import annotations

import math
from fractions import Fraction
from itertools import accumulate, cycle, islice
from numbers import Real
from typing import Any, Callable, Iterator, Sequence, Sized

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from parallel_lib.common.checks import check_int, positive_int

__all__ = ["Partition", "DataPartitioner", "PartitionSampler", "partition_lengths", "partition_dataset",
           "global_batch_indices", "check_global_batch"]


class Partition(Dataset):
    """A view of ``data`` that holds only the examples at ``index`` (in that order)."""

    def __init__(self, data: Any, index: Sequence[int]) -> None:
        self.data = data
        self.index = list(index)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> Any:
        return self.data[self.index[i]]


def _fractions(sizes: Sequence[float]) -> list[Fraction]:
    """``sizes`` as exact fractions (0.1 -> 1/10, 1/3 -> 1/3), checked to be a distribution."""
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or len(sizes) == 0 or not all(
            isinstance(s, Real) and not isinstance(s, bool) and math.isfinite(s) for s in sizes):
        raise ValueError(f"sizes must be a non-empty sequence of numbers, got sizes={sizes!r}")
    if any(s < 0 for s in sizes) or abs(math.fsum(float(s) for s in sizes) - 1.0) > 1e-6:
        raise ValueError(f"sizes must be non-negative and sum to 1, got sizes={list(sizes)} "
                         f"(sum {math.fsum(float(s) for s in sizes):g})")
    return [Fraction(s).limit_denominator(10**6) for s in sizes]


def partition_lengths(n: int, sizes: Sequence[float], drop_last: bool = False) -> list[int]:
    """How many of ``n`` examples each part gets (see the module docstring for the rule).

    >>> partition_lengths(10, [1/3, 1/3, 1/3]), partition_lengths(10, [1/3] * 3, drop_last=True)
    ([3, 4, 3], [3, 3, 3])
    """
    fractions = _fractions(sizes)
    if drop_last:
        return [math.floor(f * n) for f in fractions]
    bounds = [math.floor(c * n + Fraction(1, 2)) for c in accumulate(fractions)]
    bounds[-1] = n  # the sizes may sum to 1 only up to float rounding
    return [end - start for start, end in zip([0] + bounds[:-1], bounds)]


class DataPartitioner:
    """Shuffle ``data`` the same way on every rank and cut it into ``len(sizes)`` parts.

    Args:
        data: anything with ``len`` and integer indexing (a list, a torch ``Dataset``).
        sizes: fraction of the data per part; non-negative, summing to 1.
        seed: seed of the shuffle, the same on every rank.
        drop_last: give part ``k`` exactly ``floor(sizes[k] * len(data))`` examples and
            leave the remainder out, instead of placing every example in some part.

    Raises:
        ValueError: bad ``sizes`` or ``seed``.
    """

    def __init__(self, data: Sized, sizes: Sequence[float] = (0.5, 0.5), seed: int = 1234,
                 drop_last: bool = False) -> None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"seed must be an int, got seed={seed!r}")
        self.data, self.sizes, self.seed, self.drop_last = data, list(sizes), seed, drop_last
        self.lengths = partition_lengths(len(data), sizes, drop_last)
        self.epoch = 0
        self.partitions = self._split()

    def _split(self) -> list[list[int]]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.data), generator=generator).tolist()
        ends = list(accumulate(self.lengths))
        return [order[end - length: end] for end, length in zip(ends, self.lengths)]

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch``; call ``use`` again afterwards for the new parts."""
        check_int("epoch", epoch, minimum=0)  # True would silently mean epoch 1
        self.epoch = epoch
        self.partitions = self._split()

    def use(self, rank: int) -> Partition:
        """The part of ``rank`` (the ``rank``-th entry of ``sizes``) for the current epoch."""
        # check_int refuses True, which would otherwise silently mean part 1
        check_int("rank", rank, minimum=0, maximum=len(self.partitions) - 1, hint="one part per entry of sizes")
        return Partition(self.data, self.partitions[rank])


class PartitionSampler(Sampler[int]):
    """Indices into the full data set of one rank's part, equal in number on every rank.

    Args:
        num_examples: length of the data set.
        rank: this rank, in ``[0, world_size)``.
        world_size: number of ranks, each getting an equal share.
        seed: seed of the shuffle, the same on every rank.
        drop_last: leave out the ``num_examples % world_size`` last shuffled examples instead
            of repeating up to ``world_size - 1`` examples to even out the parts.
    """

    def __init__(self, num_examples: int, rank: int, world_size: int, seed: int = 1234,
                 drop_last: bool = False) -> None:
        _check_rank(rank, world_size)
        if num_examples < world_size:
            raise ValueError(f"the data set must hold at least world_size={world_size} examples, "
                             f"got {num_examples}")
        self.rank, self.drop_last = rank, drop_last
        self.partitioner = DataPartitioner(range(num_examples), [Fraction(1, world_size)] * world_size, seed,
                                           drop_last)
        self.num_samples = -(-num_examples // world_size) if not drop_last else num_examples // world_size

    @property
    def indices(self) -> list[int]:
        """This rank's indices for the current epoch, in the order they are loaded."""
        part = self.partitioner.partitions[self.rank]
        return list(islice(cycle(part), self.num_samples))  # pads by repeating the part's first examples

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` (call it on every rank before each epoch, like DistributedSampler)."""
        self.partitioner.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples


def _check_rank(rank: int, world_size: int) -> None:
    positive_int("world_size", world_size)
    check_int("rank", rank, minimum=0, maximum=world_size - 1)


def check_global_batch(batch_size: int, world_size: int) -> int:
    """The per-rank batch ``batch_size // world_size``, if the global batch divides over the ranks.

    Call it before starting ranks (the command line does), so that a batch that does not
    divide is one clear message rather than the same error from every rank.

    Raises:
        ValueError: ``world_size < 1``, a ``batch_size`` below ``world_size`` or not a multiple of it.
    """
    positive_int("world_size", world_size)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < world_size:
        raise ValueError(f"batch_size is the global batch and must be at least world_size={world_size} "
                         f"(one example per rank), got batch_size={batch_size!r}")
    if batch_size % world_size:
        lower, upper = batch_size - batch_size % world_size, batch_size - batch_size % world_size + world_size
        raise ValueError(f"batch_size={batch_size} (the global batch) does not divide evenly over "
                         f"world_size={world_size} ranks; use a multiple of {world_size}, e.g. {lower} or {upper}")
    return batch_size // world_size


def partition_dataset(rank: int, world_size: int, dataset: Any, batch_size: int = 128,
                      collate_fn: Callable[[list[Any]], Any] | None = None, seed: int = 1234,
                      drop_last: bool = False, **loader_kwargs: Any) -> DataLoader:
    """The DataLoader of ``rank``'s share of ``dataset`` (see the module docstring for which share).

    Call ``loader.sampler.set_epoch(epoch)`` before each epoch to reshuffle, on every rank.

    Args:
        rank: this rank, in ``[0, world_size)``.
        world_size: number of data-parallel ranks.
        dataset: anything with ``len`` and integer indexing.
        batch_size: the GLOBAL batch; this rank loads ``batch_size // world_size`` per step.
        collate_fn: turns a list of examples into a batch (e.g. a ``functools.partial`` of
            ``parallel_lib.data.collate_batch``); None: PyTorch's default.
        seed: seed of the shuffle, the same on every rank.
        drop_last: drop up to ``world_size - 1`` examples per epoch instead of repeating up to
            ``world_size - 1``; either way every rank gets the same number of examples and steps.
            (The last step of an epoch may be smaller, equally on every rank.)
        **loader_kwargs: more ``DataLoader`` arguments (``num_workers``, ``pin_memory``, ...).

    Raises:
        ValueError: ``world_size < 1``, ``rank`` outside ``[0, world_size)``, a global batch
            below ``world_size`` or not divisible by it, or fewer examples than ranks.
    """
    _check_rank(rank, world_size)
    local_batch = check_global_batch(batch_size, world_size)
    sampler = PartitionSampler(len(dataset), rank, world_size, seed, drop_last)
    return DataLoader(dataset, batch_size=local_batch, sampler=sampler, collate_fn=collate_fn, **loader_kwargs)


def global_batch_indices(data: Sized | int, world_size: int, batch_size: int, seed: int = 1234, epoch: int = 0,
                         drop_last: bool = False) -> list[list[int]]:
    """Indices of each step's global batch: every rank's batch of that step, in rank order.

    ``[dataset[i] for i in global_batch_indices(dataset, ...)[k]]`` is the batch a single
    process must train on in step ``k`` to match ``world_size`` ranks that use
    ``partition_dataset(rank, world_size, dataset, batch_size, seed=seed, drop_last=drop_last)``
    after ``set_epoch(epoch)``.

    Args:
        data: the data set, or its length.
        world_size, batch_size, seed, drop_last: as for ``partition_dataset``.
        epoch: the epoch set with ``set_epoch``.

    Raises:
        ValueError: as ``partition_dataset``; ``data`` neither sized nor an int >= 0 (True is not a length).
    """
    sized = hasattr(data, "__len__")
    num_examples = len(data) if sized else check_int("data", data, 0, hint="a data set or its length")
    _check_rank(0, world_size)
    local_batch = check_global_batch(batch_size, world_size)
    samplers = [PartitionSampler(num_examples, r, world_size, seed, drop_last) for r in range(world_size)]
    for sampler in samplers:
        sampler.set_epoch(epoch)
    parts = [sampler.indices for sampler in samplers]
    steps = -(-len(parts[0]) // local_batch)
    return [[i for part in parts for i in part[k * local_batch: (k + 1) * local_batch]] for k in range(steps)]
