"""The roofline numbers: measured rates are positive and consistent with timing the work directly."""

import time

import pytest
import torch

from parallel_lib.common.machine_speed import (MachineSpeed, measure_machine_speed, measure_matmul_flops,
                                               measure_memory_bandwidth)


def test_speed_is_measured_with_the_thread_count_and_device():
    speed = measure_machine_speed(size=128, megabytes=8, repeats=3)
    assert speed.device == "cpu" and speed.threads == torch.get_num_threads()
    assert speed.flops_per_second > 1e6 and speed.bytes_per_second > 1e6


def test_matmul_rate_agrees_with_a_direct_timing():
    # a rate off by a factor (n² instead of 2n³, say) would land far outside this band
    size = 256
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    times = []
    for _ in range(5):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    direct = 2 * size**3 / sorted(times)[2]
    measured = measure_matmul_flops(size=size, repeats=5)
    assert direct / 4 < measured < direct * 4


def test_roofline_time_is_the_slower_limit():
    speed = MachineSpeed("cpu", "fp32", 1, flops_per_second=1e9, bytes_per_second=1e8)
    assert speed.ridge_intensity == 10
    assert speed.seconds(flops=1e9, nbytes=1e6) == 1.0      # compute-bound
    assert speed.seconds(flops=1e6, nbytes=1e8) == 1.0      # memory-bound


@pytest.mark.parametrize("kwargs, message", [
    (dict(size=0), "size must be"), (dict(repeats=-1), "repeats must be"), (dict(dtype="int8"), "dtype must be"),
])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        measure_matmul_flops(**kwargs)


def test_bad_device_type_is_named():
    with pytest.raises(TypeError, match="device must be"):
        measure_memory_bandwidth(device=3)
