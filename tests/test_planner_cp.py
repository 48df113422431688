"""The planner learns context parallelism (chapter 11): a cp axis's memory and traffic, and Llama 3 405B's
long-context stage (Llama Team 2024, table 4: TP 8, CP 16, PP 16, DP 8 on 16,384 H100s, sequence 131,072,
16 sequences per data-parallel replica, 16M tokens per batch) priced beside its 8K stage (CP 1, DP 128)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from parallel_lib.context_parallel.cost import cp_wire_bytes
from parallel_lib.cost.units import GiB
from parallel_lib.planner.calibrate import AlphaBeta
from parallel_lib.planner.hardware import GPUS, NETWORK_LATENCY, published_calibration
from parallel_lib.planner.layout import Layout, StepCost, cp_seconds, price
from parallel_lib.planner.published import LLAMA3, LONG_CONTEXT, RUNS, compare_run

H100 = GPUS["H100"]
PEAK = StepCost(0.0, H100.flops_bf16)


def _price(run, layout=None):
    return price(layout or run.layout, run.shape, run.global_batch, run.seq_len, published_calibration("H100"), PEAK)


def test_the_ring_priced_by_the_planner_sends_the_bytes_the_counter_counts():
    """With compute free (nothing hides) the seconds are the sends' latencies and bytes; with slow compute only the
    last dK/dV step home shows. 405B on TP 8: 16 query heads and 1 key/value head per rank (GQA)."""
    shape, mb, s, tp, cp = LLAMA3["405B"], 1, 131_072, 8, 16
    wire = cp_wire_bytes("ring", mb, 1, s, 128, cp, itemsize=2)     # what ring attention's ranks were counted sending
    assert cp_seconds(shape, mb, s, tp, cp, 1e30, AlphaBeta(0.0, 1.0), 2) == pytest.approx(wire.total)
    assert cp_seconds(shape, mb, s, tp, cp, 1e30, AlphaBeta(1.0, 1e30), 2) == pytest.approx(2 * (cp - 1) + 1)
    last_home = 2 * mb * (s // cp) * 128 * 4                          # dK and dV of one block, fp32
    assert cp_seconds(shape, mb, s, tp, cp, 1.0, AlphaBeta(1e-6, 1e9), 2) == pytest.approx(1e-6 + last_home / 1e9)
    assert cp_seconds(shape, mb, s, tp, 1, 1.0, AlphaBeta(1.0, 1.0), 2) == 0.0


def test_llama3_405b_long_context_stage_is_table_4s_and_cp_keeps_the_8k_stages_memory():
    run, layout = LONG_CONTEXT, LONG_CONTEXT.layout
    assert (layout.tp, layout.cp, layout.pp, layout.dp) == (8, 16, 16, 8) and run.devices == layout.devices == 16_384
    assert run.seq_len == 131_072 and run.global_batch // layout.dp == layout.micro_batches == 16  # batch size/DP 16
    assert run.global_batch * run.seq_len == 16 * 2**20                                          # 16M tokens
    assert layout.name == "DP8×TP8×PP16×CP16 ZeRO-2, SP, interleaved v=2 m=16"
    long, short = _price(run), _price(RUNS[0])
    # 131,072 / CP 16 = 8,192 tokens per GPU, as in the 8K stage; ZeRO over dp · cp = 128 ranks, as over DP 128
    assert long.memory_bytes == short.memory_bytes and round(long.memory_bytes / GiB, 1) == 74.8
    assert long.memory_bytes <= H100.memory_bytes
    without = _price(run, replace(layout, cp=1))       # the same grid without CP: every GPU holds whole sequences
    assert without.activation_bytes == 16 * long.activation_bytes and without.memory_bytes > 10 * H100.memory_bytes
    # at 8,192 tokens per rank a ring step's attention (16 query heads) hides its K/V transfer (1 key/value head):
    # what shows is the last dK/dV step of each block and micro-batch
    assert 0 < long.cp_comm < 0.01 * long.compute
    # 16 micro-batches x 8 blocks (126 over 16 stages: the first 14 take 8), each a message across nodes (tp · cp = 128
    # ranks span 16 nodes) of one block's fp32 dK and dV
    last_home = NETWORK_LATENCY + 2 * 8192 * 128 * 4 / H100.network
    assert long.cp_comm == pytest.approx(16 * 8 * last_home, rel=1e-9)


def test_the_search_prefers_cp_at_131k_tokens():
    """Without CP a 131k-token sequence fits only as one micro-batch per replica (its activations are the 8K stage's
    16 micro-batches at once), so a pipeline runs with m = 1: nearly all bubble. CP 16 keeps m = 16."""
    compared = compare_run(LONG_CONTEXT, context_parallel=(1, 16))
    best = compared.plan.best
    assert best is not None and best.layout.cp == 16
    no_cp = [c for c in compared.plan.ranked if c.layout.cp == 1]
    assert no_cp and all(c.layout.micro_batches <= 2 for c in no_cp)
    assert no_cp[0].priced.step_seconds > 5 * best.priced.step_seconds
    assert compared.theirs is not None and compared.theirs.layout == LONG_CONTEXT.layout
    assert compared.theirs.step_seconds < no_cp[0].priced.step_seconds / 5


def test_bad_cp_layouts_are_refused():
    with pytest.raises(ValueError, match="cp must be an int >= 1"):
        Layout(cp=0)
    with pytest.raises(ValueError, match=r"seq_len=100 must be divisible by 2·cp = 16"):
        price(Layout(cp=8), LLAMA3["8B"], 8, 100, published_calibration("H100"), PEAK)
