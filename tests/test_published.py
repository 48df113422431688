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
from parallel_lib.planner.published import LONG_CONTEXT, RUNS, compare_run, table


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


def _row(run):  # type: ignore[no-untyped-def]
    """The run as a paper's table row: GPUs, TP, CP, PP, DP, sequence, batch, micro-batches and v per replica."""
    lay = run.layout
    return (run.devices, lay.tp, lay.cp, lay.pp, lay.dp, run.seq_len, run.global_batch, lay.micro_batches, lay.virtual)


def test_published_runs_are_the_papers_numbers():
    """Each literal below was read from the paper (or, where it says so, the authors' scripts), not computed."""
    llama, gpt145, gpt175, _ = RUNS
    # Llama Team 2024 (arXiv:2407.21783), table 4, p. 10, 2nd row: GPUs 16,384, TP 8, CP 1, PP 16, DP 128,
    # Seq. Len. 8,192, Batch size/DP 16 (2,048 sequences); m = 16 and v = 2 are the course's assumptions
    assert _row(llama) == (16_384, 8, 1, 16, 128, 8192, 128 * 16, 16, 2)
    assert (llama.reported_tflops, llama.reported_peak) == (400, 0.41)  # TFLOPs/GPU 400, BF16 MFU 41%
    assert (llama.layout.zero, llama.layout.recompute) == (2, False)  # sec. 3.3.2, pp. 10-11
    # table 3, p. 7: 126 layers, model dimension 16,384, FFN 53,248, 128 heads, 8 key/value heads
    s = llama.shape
    assert (s.n_layer, s.n_embd, s.ffn_hidden, s.n_head, s.kv_heads) == (126, 16_384, 53_248, 128, 8)
    # table 4, p. 10, 3rd row: 16,384 GPUs, TP 8, CP 16, PP 16, Seq. Len. 131,072, Batch size/DP 16, 380, 38%;
    # the row prints DP 4, but 8·16·16·4 = 8,192 GPUs and 4·16·131,072 = 8.4M tokens, not its 16,384 and 16M
    assert _row(LONG_CONTEXT) == (16_384, 8, 16, 16, 8, 131_072, 8 * 16, 16, 2)
    assert (LONG_CONTEXT.reported_tflops, LONG_CONTEXT.reported_peak) == (380, 0.38)
    for run in (llama, LONG_CONTEXT):  # Tokens/Batch "16M" in both rows
        assert run.global_batch * run.seq_len == 16 * 2**20
    # Narayanan et al. 2021, table 1, p. 8, the 145.6B row: 96 heads, hidden 12288, 80 layers, TP 8, PP 8,
    # 1536 GPUs, batch 2304, 148 teraFLOP/s per GPU, 47% of peak; sequence 2048 and vocabulary 51,200 (sec. 5.1).
    # Micro-batch 2 (m = 2304 / (24 · 2) = 48) and 5 layers per virtual stage (v = 2): examples/sc21/run_table_1.sh
    s = gpt145.shape
    assert (s.n_head, s.n_embd, s.n_layer, s.vocab_size) == (96, 12288, 80, 51_200)
    assert _row(gpt145) == (1536, 8, 1, 8, 24, 2048, 2304, 48, 2)
    assert (gpt145.reported_tflops, gpt145.reported_peak) == (148, 0.47)
    # table 2, p. 9, PTD-P on 1536 GPUs: model-parallel size 96, batch 1536, micro-batch 1 (m = 96), 141 teraFLOP/s
    # per GPU, no share of peak printed; 96 layers, 96 heads, hidden 12288 (sec. 5.3.2). TP 8 x PP 12 with 2 layers
    # per virtual stage (v = 4): the authors' 175B runs on 96 GPUs, examples/sc21/run_figure_12.sh, not table 2
    s = gpt175.shape
    assert (s.n_head, s.n_embd, s.n_layer, s.vocab_size) == (96, 12288, 96, 51_200)
    assert _row(gpt175) == (1536, 8, 1, 12, 16, 2048, 1536, 96, 4)
    assert (gpt175.reported_tflops, gpt175.reported_peak) == (141, None)
    for run in (gpt145, gpt175):  # "all of our results are run with mixed precision" (sec. 5, p. 7); --fp16
        assert run.layout.dtype == "fp16" and run.layout.recompute and run.layout.schedule == "interleaved"


def test_the_published_table_says_what_each_paper_reports():
    rows = table([compare_run(RUNS[0])])
    assert rows[0][-1] == ("Llama Team 2024, table 4, p. 10 (TP 8, CP 1, PP 16, DP 128); "
                           "reported 400 TFLOP/s per GPU, 41% of peak")
