"""The planner prices ZeRO and tensor parallelism with the formulas chapters 06 and 07 verified."""

import pytest

from parallel_lib.model_parallel.memory import MODEL_SHAPES, GiB
from parallel_lib.planner.sharded_tensor import tensor_parallel_option, zero_option
from parallel_lib.planner.strategy import PART_ONE, STRATEGIES, plan
from parallel_lib.sharding.memory import zero_memory, zero_traffic

LLAMA = MODEL_SHAPES["llama-2-7b"]


def test_part_one_stays_the_default():
    assert [o.strategy for o in plan("llama-2-7b", 4096, 64, 80, 8).options] == list(PART_ONE)


def test_zero_takes_the_lowest_stage_that_fits_and_prices_it_with_chapter_06s_formulas():
    option = plan("llama-2-7b", 4096, 64, 80, 8, strategies=STRATEGIES).option("ZeRO")
    assert option.strategy == "ZeRO-1" and option.feasible and not option.recompute
    assert option.state_bytes == zero_memory(LLAMA.n_params, 8, 1, "bf16")["total"]
    assert option.allreduce_bytes == zero_traffic(LLAMA.n_params, 8, 1, "bf16")
    # stage 1 needs 34.5 GiB of state and one 4k sequence 17 GiB of activations: a 48 GiB GPU needs stage 2
    tighter = zero_option(LLAMA, 4096, 64, 48 * GiB, 8)
    assert tighter.strategy == "ZeRO-2" and tighter.state_bytes == zero_memory(LLAMA.n_params, 8, 2)["total"]


def test_zero_recomputes_only_as_the_last_resort():
    # 18 GiB: ZeRO-3's 12.6 GiB of shards and 2.2 GiB of gathered working set (issue #21: 16 GiB no longer
    # holds them with a recomputed sequence) + 1.5 GiB of one recomputed 4k sequence fit, its 17 GiB in full do not
    option = zero_option(LLAMA, 4096, 64, 18 * GiB, 8)
    assert option.strategy == "ZeRO-3" and option.feasible and option.recompute
    assert zero_option(LLAMA, 4096, 64, 18 * GiB, 8, recompute=False).feasible is False


def test_zero_needs_ranks_and_an_optimizer():
    assert not zero_option(LLAMA, 4096, 64, 80 * GiB, 1).feasible
    assert not zero_option(LLAMA, 4096, 64, 80 * GiB, 8, optimizer=None).feasible


def test_tensor_parallel_degree_divides_the_heads_and_stays_inside_a_node():
    option = tensor_parallel_option(LLAMA, 4096, 64, 80 * GiB, 8)
    assert option.strategy == "TP×DP" and (option.replicas, option.stages) == (4, 2)
    t, rows, h = 2, 64 // 4, LLAMA.hidden
    assert option.p2p_bytes == LLAMA.n_layers * 4 * 2 * (t - 1) / t * rows * 4096 * h * 2  # 4 all-reduces per block
    assert tensor_parallel_option(LLAMA, 4096, 64, 16 * GiB, 64, gpus_per_node=4).stages <= 4
    xl = MODEL_SHAPES["gpt2-xl (1.5B)"]  # 25 heads: no degree 2..8 divides them and 8 GPUs
    assert not tensor_parallel_option(xl, 1024, 8, 80 * GiB, 8).feasible


@pytest.mark.parametrize("strategies", [(), "ZeRO", ("DP", "FSDP")])
def test_bad_strategies(strategies):
    with pytest.raises(ValueError, match="strategies must be"):
        plan("llama-2-7b", 4096, 64, 80, 8, strategies=strategies)
