"""Smoke run of ``python -m parallel_lib.bench moe --quick``: every run's row, the counted all-to-all bytes equal to the
formula, the expert-compute table, and Mixtral 8x7B and DeepSeek-V3 by the cost model."""

import re

from parallel_lib.bench.__main__ import main as bench_main


def test_quick_moe_benchmark_prints_every_run_and_the_real_models(capsys):
    assert bench_main(["moe", "--quick"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("### Mixture of experts — step time, load and all-to-all bytes against ep and top-k, ")
    for top_k, kb in ((1, "65.7"), (2, "131.2")):  # 4 layers · (4 all-to-alls · 16 tokens · k · 64 · 4 B + 4 · 8)
        for aux in ("0", "0.1"):
            measured = r"[\d.]+ \| " * 4  # step ms, busiest expert, busiest rank, busiest rank's expert time
            assert re.search(rf"\| 2 \| {top_k} \| {aux} \| {measured}{kb} / {kb} \| yes \|", out), (top_k, aux)
    assert re.search(r"\| 4 \| 64 \| 16 \| [\d.]+ \| [\d.]+ \| [\d.]+× \|", out)
    assert "| Mixtral 8x7B | 46.7 | 12.9 | EP 8, DP 64, PP 1, ZeRO-1 | 35." in out
    assert "| DeepSeek-V3 | 671.0 | 37.6 | EP 64, DP 128, PP 16, ZeRO-1 | 10.0 |" in out
