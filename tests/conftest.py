"""Shared test set-up: every test starts from the same random state, one thread.

One intra-op thread keeps tests that compare threads, processes and pipeline
stages from fighting over the cores, and makes float results reproducible.
"""

import random

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_and_threads():
    threads = torch.get_num_threads()
    torch.manual_seed(0)
    random.seed(0)
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def one_rank_group():
    """A gloo group of one rank in this process: enough to drive an engine's code paths without launching ranks."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
