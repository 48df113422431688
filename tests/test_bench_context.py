"""Smoke run of ``python -m parallel_lib.bench context --quick``: every method's row, the census and the bytes sent
equal to the formulas (the literals below are the formulas worked by hand), the causal work per rank, the hiding
length measured and predicted."""

import re

import pytest

from parallel_lib.bench import context
from parallel_lib.bench.__main__ import main as bench_main
from parallel_lib.context_parallel.measure import RingStepMeasured, measured_hiding_seq_len


def test_quick_context_benchmark_prints_memory_work_and_hiding(capsys):
    assert bench_main(["context", "--quick"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("### Context parallelism — memory per rank and step time against sequence length, ")
    # full attention keeps b·n·s² fp32 probabilities and the s² causal mask: 4·64²·4 + 64² bytes = 68 KiB;
    # tiled keeps out and lse, b·n·s·(d + 1)·4 = 9 KiB; ring a rank's half of that; Ulysses its 2 heads' q, k, v,
    # out, lse and the positions. Sent: ring 2 K/V blocks forward, 2 back and 2 fp32 dK/dV blocks = 32 KiB.
    for row in ("| full | - | 1 | 64 | 68.0 | 68.0 |", "| tiled | - | 1 | 64 | 9.0 | 9.0 |",
                "| ring | contiguous | 2 | 64 | 4.5 | 4.5 |", "| ring | zigzag | 2 | 64 | 4.5 | 4.5 |",
                "| ulysses | contiguous | 2 | 64 | 17.0 | 17.0 |"):
        assert row in out, row
    assert re.search(r"\| ring \| zigzag \| 2 \| 64 \| 4\.5 \| 4\.5 \| [\d.,]+ \| 32\.0 \| 32\.0 \|", out)
    assert "Census vs formula, largest deviation: 0.0% (within 5%); bytes sent vs formula: equal on every rank" in out
    # causal work at s = 64, cp = 2, tiles of 8: chunks of 16 tokens; contiguous 640 : 1,664 entries, zig-zag even
    assert "| contiguous | 2 | 640, 1,664 | 2.60 : 1 | 3 : 1 |" in out
    assert "| zigzag | 2 | 1,152, 1,152 | 1.00 : 1 | 3 : 1 |" in out
    # one ring step's message is one K and one V block: 2 · 4 heads · 32 tokens · 8 · 4 bytes = 8 KiB at s = 64
    assert re.search(r"\| 64 \| 32 \| [\d.,]+ \| [\d.,]+ \| 8 \| (yes|no) \|", out)
    assert re.search(r"- predicted \(α–β, this machine\): hidden from sequence [\d,]+", out)
    assert re.search(r"- measured: hidden from sequence ([\d,]+|none of those measured)", out)
    # at H100 figures: 4·b·n·d·L²/F = α + 2·b·n·d·2·L/β has its root at L ≈ 1,109 tokens per rank,
    # s = 16·L rounded up to a multiple of 2·cp = 32
    assert "cp 16): hidden from sequence 17,760" in out


def test_the_measured_hiding_length_is_where_compute_stays_ahead():
    def step(s, compute, transfer):
        return RingStepMeasured(s, compute, transfer, 8 * s)

    assert measured_hiding_seq_len([step(64, 2.0, 1.0), step(16, 0.1, 1.0), step(32, 0.5, 1.0)]) == 64
    # compute ahead by noise at 16, then behind at 32: only from 64 on does it stay ahead
    assert measured_hiding_seq_len([step(16, 1.1, 1.0), step(32, 0.9, 1.0), step(64, 3.0, 1.0)]) == 64
    assert measured_hiding_seq_len([step(16, 0.1, 1.0), step(32, 0.2, 1.0)]) is None


def test_bad_benchmark_settings_are_refused():
    with pytest.raises(ValueError, match="divisible by 2·cp = 8, got 36"):
        context.measure(context.Config(seq_lens=(32, 36), cps=(4,)))
    with pytest.raises(ValueError, match="every cp must be >= 2"):
        context.measure(context.Config(cps=(1,)))
