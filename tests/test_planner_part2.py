"""ZeRO and tensor parallelism among chapter 05's named strategies: layouts priced by planner.layout.price.

Every number is checked against a literal worked out by hand: the ZeRO paper's bytes per parameter
(Rajbhandari et al. 2020, sec. 5: 2Ψ + 2Ψ + KΨ/N at stage 1, 2Ψ + (2 + K)Ψ/N at stage 2, K = 12),
its traffic (sec. 7: 2 passes of (N-1)/N of the 2Ψ fp16 bytes at stages 0-1), and tensor
parallelism's collectives per block (Megatron-LM's 4 all-reduces, or under sequence parallelism as
many all-gathers and reduce-scatters, and the backward's re-gather of the two column-parallel inputs).
"""

import pytest

from parallel_lib.planner.hardware import Links
from parallel_lib.planner.strategy import PART_ONE, STRATEGIES, plan

PSI = 6_738_415_616  # LLaMA-2-7B's parameters (meta-llama/Llama-2-7b-hf, untied head)


def _zero(gpu_gib, **kwargs):
    return plan("llama-2-7b", 4096, 64, gpu_gib, 8, strategies=("ZeRO",), **kwargs).option("ZeRO")


def test_part_one_stays_the_default():
    assert [o.strategy for o in plan("llama-2-7b", 4096, 64, 80, 8).options] == list(PART_ONE)


def test_zero_takes_the_lowest_stage_that_fits_and_prices_it_with_chapter_06s_formulas():
    option = plan("llama-2-7b", 4096, 64, 80, 8, strategies=STRATEGIES).option("ZeRO")
    assert option.strategy == "ZeRO-1" and option.feasible and not option.recompute
    assert option.state_bytes == (2 + 2 + 12 / 8) * PSI == 37_061_285_888  # ZeRO-1 over 8: 5.5 Ψ
    assert option.allreduce_bytes == 2 * 7 / 8 * 2 * PSI == 23_584_454_656  # a reduce-scatter and an all-gather
    # stage 1's 34.5 GiB of state and one 4k sequence's 34·s·h x 32 layers = 17 GiB of activations exceed a 48 GiB
    # GPU: stage 2 (2Ψ + 14Ψ/8 = 3.75 Ψ = 23.5 GiB) does it with one sequence per micro-batch
    tighter = _zero(48)
    assert tighter.strategy == "ZeRO-2" and tighter.state_bytes == 3.75 * PSI == 25_269_058_560
    assert tighter.micro_batches == 8 and tighter.activation_bytes == 34 * 4096 * 4096 * 32


def test_zero_recomputes_only_as_the_last_resort():
    # 18 GiB: ZeRO-3's 12.6 GiB of shards and its gathered working set + one micro-batch's recomputed activations
    # fit; with the 17 GiB of one sequence in full nothing does
    option = _zero(18)
    assert option.strategy == "ZeRO-3" and option.feasible and option.recompute
    assert _zero(18, recompute=False).feasible is False


def test_zero_needs_ranks():
    assert not plan("llama-2-7b", 4096, 64, 80, 1, strategies=("ZeRO",)).option("ZeRO").feasible
    assert "one replica" in " ".join(plan("llama-2-7b", 4096, 64, 80, 1, strategies=("ZeRO",)).option("ZeRO").reasons)


def test_tensor_parallel_degree_divides_the_heads_and_stays_inside_a_node():
    option = plan("llama-2-7b", 4096, 64, 80, 8, strategies=STRATEGIES).option("TP×DP")
    assert option.strategy == "TP×DP" and (option.replicas, option.stages) == (4, 2)
    assert option.micro_batches == 8  # 16 sequences per replica, 2 per micro-batch
    # one micro-batch's (s, h) in fp16: S = 2 x 4096 x 4096 x 2 bytes; each all-gather or reduce-scatter over t = 2
    # sends (t-1)/t S = S/2. Per block 4 forward (2 AG + 2 RS, Megatron's 2 all-reduces) and 6 backward (2 more
    # all-gathers: the column-parallel inputs SP kept as slices): 5 S. The embedding and head 4 x S/2, the loss 3
    # all-reduces of 2 x 4096 fp32 values (S' = 32,768 each, 2 x 1/2 x S' sent), and SP's gradient all-reduce of
    # the sequence-parallel parameters' gradients: Llama has no biases and no position table, only two RMSNorm
    # weights per block and the final norm's, (32 x 2h + h) x 2 bytes = 532,480 (GPT-2's count, 32 x 6h + 2h + 4096 h,
    # 35,143,680 bytes, was priced here before)
    S = 2 * 4096 * 4096 * 2
    per_micro_batch = 32 * 5 * S + 2 * S + 3 * 32_768 + 532_480
    assert option.p2p_bytes == 8 * per_micro_batch == 86_978_134_016
    # a tp rank holds half of each block's matrices (2h² + 2h·kv + 3h·ffn = 202,375,168) and both RMSNorm weights
    # (2h), half the embedding and half the head (32,000 x 4096 each), and the final norm (h)
    params = 32 * (202_375_168 // 2 + 2 * 4096) + 2 * 32_000 * 4096 // 2 + 4096
    assert option.priced.params == params == 3_369_340_928
    # the gradient all-reduce over the 4 replicas of those fp16 gradients: 2 x 3/4 x 2 bytes each
    assert option.allreduce_bytes == 2 * 3 / 4 * 2 * params == 10_108_022_784
    small_nodes = plan("llama-2-7b", 4096, 64, 16, 64, strategies=STRATEGIES, links=Links(450e9, 50e9, 4))
    assert small_nodes.option("TP×DP").stages <= 4
    xl = plan("gpt2-xl (1.5B)", 1024, 8, 80, 8, strategies=STRATEGIES)  # 25 heads: no degree 2..8 divides them
    assert not xl.option("TP×DP").feasible


@pytest.mark.parametrize("strategies", [(), "ZeRO", ("DP", "FSDP")])
def test_bad_strategies(strategies):
    with pytest.raises(ValueError, match="strategies must be"):
        plan("llama-2-7b", 4096, 64, 80, 8, strategies=strategies)
