"""Tests for parallel_lib.data: exact coverage, equal steps per rank, shuffles, global batches."""

import math

import pytest

from parallel_lib.data import (
    DataPartitioner,
    Partition,
    PartitionSampler,
    global_batch_indices,
    partition_dataset,
    partition_lengths,
)


@pytest.mark.parametrize("n, sizes", [(10, [0.5, 0.5]), (7, [0.5, 0.5]), (10, [1 / 3] * 3), (101, [0.7, 0.2, 0.1]),
                                      (5, [0.25] * 4), (3, [1 / 7] * 7), (0, [1.0]), (13, [0.0, 1.0])])
def test_every_example_lands_in_exactly_one_partition(n, sizes):
    partitioner = DataPartitioner(list(range(n)), sizes, seed=0)
    parts = [list(partitioner.use(rank)) for rank in range(len(sizes))]
    assert sorted(i for part in parts for i in part) == list(range(n))
    assert [len(part) for part in parts] == partition_lengths(n, sizes)


def test_partition_lengths_follow_the_documented_rounding():
    assert partition_lengths(10, [1 / 3] * 3) == [3, 4, 3]  # bounds round(10/3)=3, round(20/3)=7, 10
    assert partition_lengths(10, [0.25] * 4) == [3, 2, 3, 2]  # halves round up: 2.5 -> 3, 7.5 -> 8
    assert partition_lengths(7, [0.5, 0.5]) == [4, 3]
    assert partition_lengths(100, [0.7, 0.2, 0.1]) == [70, 20, 10]
    # drop_last: floor(size * n) each; exact, where the naive int(0.29 * 100) gives 28
    assert partition_lengths(10, [1 / 3] * 3, drop_last=True) == [3, 3, 3]
    assert partition_lengths(100, [0.29, 0.71], drop_last=True) == [29, 71]


@pytest.mark.parametrize("parts", [1, 2, 3, 5, 7])
def test_equal_sizes_give_lengths_within_one(parts):
    for n in range(0, 60):
        lengths = partition_lengths(n, [1 / parts] * parts)
        assert sum(lengths) == n and max(lengths) - min(lengths) <= 1, (n, lengths)


def test_drop_last_leaves_out_the_remainder_only():
    partitioner = DataPartitioner(list(range(11)), [0.5, 0.5], seed=3, drop_last=True)
    first, second = partitioner.use(0).index, partitioner.use(1).index
    assert len(first) == len(second) == 5 and not set(first) & set(second)


def test_shuffle_is_the_same_for_a_seed_and_differs_between_seeds():
    a, b = DataPartitioner(range(100), seed=1), DataPartitioner(range(100), seed=1)
    assert a.partitions == b.partitions  # what two ranks compute independently
    assert a.partitions != DataPartitioner(range(100), seed=2).partitions
    assert a.use(0).index != sorted(a.use(0).index)  # actually shuffled


def test_set_epoch_reshuffles_reproducibly():
    a, b = DataPartitioner(range(50), seed=5), DataPartitioner(range(50), seed=5)
    epoch0 = a.partitions
    a.set_epoch(1)
    b.set_epoch(1)
    assert a.partitions == b.partitions != epoch0
    a.set_epoch(0)
    assert a.partitions == epoch0


def test_partition_is_a_view_of_the_data():
    data = list("abcdefghij")
    part = DataPartitioner(data, [0.3, 0.7], seed=0).use(1)
    assert isinstance(part, Partition) and len(part) == 7
    assert [part[i] for i in range(len(part))] == [data[j] for j in part.index]


@pytest.mark.parametrize("sizes, match", [([0.5, 0.6], "sum to 1"), ([-0.5, 1.5], "non-negative"),
                                          ([], "non-empty"), ("ab", "non-empty"), ([0.5, None], "non-empty")])
def test_bad_sizes_are_rejected(sizes, match):
    with pytest.raises(ValueError, match=match):
        DataPartitioner(range(10), sizes)


def test_bad_rank_seed_and_epoch_are_rejected():
    partitioner = DataPartitioner(range(10), [0.5, 0.5])
    with pytest.raises(ValueError, match=r"rank must be an int in 0..1, got rank=2"):
        partitioner.use(2)
    with pytest.raises(ValueError, match="epoch must be an int >= 0"):
        partitioner.set_epoch(-1)
    with pytest.raises(ValueError, match="seed must be an int"):
        DataPartitioner(range(10), seed=1.5)


@pytest.mark.parametrize("kwargs, match", [
    (dict(rank=0, world_size=0), "world_size must be an int >= 1, got world_size=0"),
    (dict(rank=2, world_size=2), r"rank must be an int in 0..1, got rank=2"),
    (dict(rank=-1, world_size=2), r"rank must be an int in 0..1, got rank=-1"),
    (dict(rank=0, world_size=4, batch_size=2), "must be at least world_size=4"),
    (dict(rank=0, world_size=3, batch_size=10), "does not divide evenly.*e.g. 9 or 12"),
    (dict(rank=0, world_size=2, dataset=[1]), "at least world_size=2 examples"),
])
def test_partition_dataset_rejects_bad_arguments(kwargs, match):
    arguments = dict(dataset=list(range(20)), batch_size=8) | kwargs
    with pytest.raises(ValueError, match=match):
        partition_dataset(**arguments)


@pytest.mark.parametrize("n, world_size, batch_size, drop_last", [
    (10, 3, 6, False), (10, 3, 6, True), (100, 4, 8, False), (7, 2, 4, False), (9, 3, 3, True), (5, 1, 2, False)])
def test_ranks_get_the_same_steps_and_together_cover_the_data(n, world_size, batch_size, drop_last):
    loaders = [partition_dataset(rank, world_size, list(range(n)), batch_size, seed=3, drop_last=drop_last)
               for rank in range(world_size)]
    assert all(loader.batch_size == batch_size // world_size for loader in loaders)
    per_rank = [[batch.tolist() for batch in loader] for loader in loaders]
    assert len({len(batches) for batches in per_rank}) == 1, "every rank must run the same number of steps"
    for step in zip(*per_rank):
        assert len({len(batch) for batch in step}) == 1, f"ranks disagree on the size of step {step}"
    seen = [i for batches in per_rank for batch in batches for i in batch]
    if drop_last:
        assert len(seen) == len(set(seen)) == world_size * (n // world_size)
    else:  # padded like DistributedSampler: all examples, at most world_size - 1 twice
        assert set(seen) == set(range(n)) and len(seen) == world_size * math.ceil(n / world_size)


def test_sampler_set_epoch_reshuffles_the_loader_on_every_rank():
    data = list(range(40))
    loaders = [partition_dataset(rank, 2, data, batch_size=8) for rank in range(2)]
    before = [loader.sampler.indices for loader in loaders]
    for loader in loaders:
        loader.sampler.set_epoch(1)
    after = [[i for batch in loader for i in batch.tolist()] for loader in loaders]
    assert after != before and sorted(after[0] + after[1]) == data
    fresh = partition_dataset(1, 2, data, batch_size=8)
    fresh.sampler.set_epoch(1)
    assert fresh.sampler.indices == after[1]  # another process computes the same epoch


def test_collate_fn_receives_each_local_batch():
    loader = partition_dataset(1, 2, list("abcdefgh"), batch_size=4, collate_fn=lambda xs: "".join(xs))
    batches = list(loader)
    assert all(isinstance(b, str) and len(b) == 2 for b in batches) and len(batches) == 2


@pytest.mark.parametrize("n, world_size, batch_size, drop_last", [(23, 3, 6, False), (23, 3, 6, True), (16, 2, 4, False)])
def test_global_batch_is_every_ranks_batch_in_rank_order(n, world_size, batch_size, drop_last):
    data = list(range(n))
    for epoch in (0, 1):
        loaders = [partition_dataset(rank, world_size, data, batch_size, seed=9, drop_last=drop_last)
                   for rank in range(world_size)]
        for loader in loaders:
            loader.sampler.set_epoch(epoch)
        per_rank = [[batch.tolist() for batch in loader] for loader in loaders]
        expected = [sum(step, []) for step in zip(*per_rank)]
        assert global_batch_indices(data, world_size, batch_size, seed=9, epoch=epoch, drop_last=drop_last) == expected
        assert global_batch_indices(n, world_size, batch_size, seed=9, epoch=epoch, drop_last=drop_last) == expected


def test_sampler_pads_by_repeating_its_own_examples():
    sampler = PartitionSampler(10, rank=1, world_size=4, seed=0)  # lengths [3, 2, 3, 2] -> padded to 3
    part = sampler.partitioner.partitions[1]
    assert len(part) == 2 and sampler.indices == part + part[:1] and len(sampler) == 3
