"""The published training runs beside the planner: units, and Meta's Llama 3 405B layout fitting its card.

Meta trained Llama 3 405B on 16,384 H100 80GB with TP 8, CP 1, PP 16, DP 128, 8,192-token sequences
and 16 sequences per data-parallel replica (Llama Team 2024, "The Llama 3 Herd of Models", table 4),
without activation recomputation (sec. 3.3.2). A planner that says this layout does not fit is wrong.
It said so (issue #21, error 2) because it read the card's "80 GB" as 80·10⁹ bytes, 74.5 GiB, where
NVML reports 81,559 MiB = 79.65 GiB for an H100 and 81,920 MiB = 80 GiB for an A100 80GB.
"""

from __future__ import annotations

import pytest

from parallel_lib.cost.units import GB, GiB, MiB
from parallel_lib.pipeline_parallel.generators import interleaved_1f1b
from parallel_lib.pipeline_parallel.schedule import make_schedule
from parallel_lib.pipeline_parallel.simulator import peak_in_flight
from parallel_lib.planner.hardware import GPUS, published_table
from parallel_lib.planner.published import RUNS, compare_run


def test_a_cards_memory_is_what_nvml_reports_in_binary_units():
    assert GPUS["H100"].memory_bytes == 81_559 * MiB and round(GPUS["H100"].memory_gib, 2) == 79.65
    assert GPUS["A100"].memory_bytes == 80 * GiB
    assert GPUS["A100"].memory_gb * GB == GPUS["A100"].memory_bytes  # callers that multiply by 1e9 get bytes
    assert round(80 * GB / GiB, 1) == 74.5  # the old reading of "80 GB"
    assert [row[3] for row in published_table()] == ["79.65", "80.00", "32.00"]  # the table prints GiB


def test_metas_llama3_405b_layout_is_table_4s_and_fits_its_h100s():
    run = RUNS[0]
    layout = run.layout
    assert (layout.tp, layout.pp, layout.dp, run.devices) == (8, 16, 128, 16_384)  # table 4 (CP 1)
    assert run.seq_len == 8192 and run.global_batch // layout.dp == layout.micro_batches == 16  # batch size/DP 16
    assert run.global_batch * run.seq_len == 16 * 2**20  # 16M tokens per batch
    assert not layout.recompute
    theirs = compare_run(run).theirs
    assert round(theirs.memory_bytes / GiB, 1) == 74.8  # 75.1 with the GPT-shaped 405B it had before
    assert theirs.memory_bytes <= GPUS["H100"].memory_bytes  # fits: 4.8 GiB left for CUDA, NCCL and the allocator
    assert theirs.memory_bytes > 80 * GB  # what the planner compared with before: "does NOT fit"


def test_at_m_equal_p_the_interleaved_order_holds_every_micro_batch_on_every_rank():
    """Megatron's interleaved schedule warms up with 2(p - 1 - r) + (v - 1)p chunk forwards on rank r, capped at
    all m·v: at m = p = 16 that is every forward first, so every rank, not only the first, holds all 16
    micro-batches' activations (1F1B's rank r holds p - r). Meta's 68 GiB of activations come from there."""
    assert peak_in_flight(interleaved_1f1b(16, 16, 2)) == [16.0] * 16
    assert peak_in_flight(make_schedule("1f1b", 16, 16)) == [16.0 - r for r in range(16)]
    assert max(peak_in_flight(interleaved_1f1b(16, 32, 2))) == pytest.approx((2 * 15 + 16) / 2 + 0.5)
