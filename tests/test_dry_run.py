"""The memory dry run: PyTorch's FSDP2 over a fake process group at 8 to 1,024 ranks, against the formula.

GPT-2 XL and Llama 3 8B are built by Hugging Face's classes on the meta device and sharded by
``fully_shard`` in this one process; rank 0's local shard must be the padded formula's size exactly
(within the issue's 1 %, it is exact), and at 1,024 ranks the paper's ``Ψ / N`` misses GPT-2 XL's by 22 %.
"""

from __future__ import annotations

import pytest

from parallel_lib.cost.zero import fsdp_shard_numel
from parallel_lib.planner.dry_run import dry_run_rows, fsdp_local_numel
from parallel_lib.planner.published import LLAMA3
from parallel_lib.tensor_parallel.cost import GPTShape, shard_parameters

GPT2_XL = GPTShape(48, 1600, 25, 50257, 1024)


@pytest.mark.parametrize("name, shape", [("GPT-2 XL", GPT2_XL), ("Llama 3 8B", LLAMA3["8B"])])
@pytest.mark.parametrize("world_size", [8, 1024])
def test_fsdp2s_shard_is_the_padded_formula(name, shape, world_size):
    measured = fsdp_local_numel(shape, world_size)
    assert measured == fsdp_shard_numel(shape.parameter_shapes(), world_size)
    assert measured >= shard_parameters(shape, 1) / world_size


def test_padding_grows_with_the_ranks():
    rows = dry_run_rows({"GPT-2 XL": GPT2_XL}, (8, 1024))
    assert [row[-1] for row in rows] == ["1.000", "1.216"]  # 1,849,156 elements where Ψ/N = 1,521,105
    assert rows[1][2] == "1,849,156"


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="rank"):
        fsdp_local_numel(GPT2_XL, 8, rank=8)
    with pytest.raises(ValueError, match=r"shapes\[0\]"):
        fsdp_shard_numel([(0, 4)], 8)
