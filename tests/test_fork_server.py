"""The fork server never initialises CUDA, and a rank refuses to choose its GPU once CUDA is initialised.

A CUDA context does not survive ``fork``: ranks forked from a server that touched the GPU would
fail at their first CUDA call, on a GPU machine only. Neither can happen on this CPU, so the tests
check the two guards themselves: the server's environment and the rank's check.
"""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest
import torch

from parallel_lib.runtime import launch
from parallel_lib.runtime.launcher import NVML_CHECK
from parallel_lib.runtime.spawned import check_cuda_untouched


def fork_server_view(rank: int, world_size: int) -> tuple[bool, bool, bool]:
    """(CUDA initialised here, the NVML variable in this rank's environment, in its parent's: the fork server)."""
    server = Path(f"/proc/{os.getppid()}/environ").read_bytes().split(b"\0")
    return torch.cuda.is_initialized(), NVML_CHECK in os.environ, f"{NVML_CHECK}=1".encode() in server


@pytest.mark.skipif("forkserver" not in multiprocessing.get_all_start_methods() or not Path("/proc/self").exists(),
                    reason="needs a fork server and /proc")
def test_the_fork_server_asks_nvml_and_ranks_keep_the_callers_environment():
    assert NVML_CHECK not in os.environ, "run the tests without PYTORCH_NVML_BASED_CUDA_CHECK set"
    for initialised, in_rank, in_server in launch(fork_server_view, 2, backend="gloo", timeout=60):
        assert (initialised, in_rank, in_server) == (False, False, True)
    assert NVML_CHECK not in os.environ  # set for the server's start only


def test_a_rank_refuses_to_choose_its_gpu_once_cuda_is_initialised():
    check_cuda_untouched(0, lambda: False)
    with pytest.raises(RuntimeError, match=r"rank 3: CUDA is already initialised before torch\.cuda\.set_device"):
        check_cuda_untouched(3, lambda: True)
