"""Shared test set-up: every test starts from the same random state, one thread, under the collective guard.

One intra-op thread keeps tests that compare threads, processes and pipeline
stages from fighting over the cores, and makes float results reproducible.

The collective guard (:mod:`parallel_lib.runtime.guard`) checks NCCL's two rules on every
``torch.distributed`` call: in the test process through the fixture below, and in every rank
``launch`` starts through ``PARALLEL_LIB_GUARD=1``, which ranks inherit from this process.
A CPU run thus fails where a GPU run would crash or hang.
"""

import os
import random

import pytest
import torch

from parallel_lib.runtime.guard import GUARD_ENV, collective_guard

os.environ[GUARD_ENV] = "1"


@pytest.fixture(autouse=True)
def _seed_and_threads():
    threads = torch.get_num_threads()
    torch.manual_seed(0)
    random.seed(0)
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _collective_guard():
    with collective_guard():
        yield


@pytest.fixture
def one_rank_group():
    """A gloo group of one rank in this process: enough to drive an engine's code paths without launching ranks."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
