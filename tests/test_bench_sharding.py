"""Smoke run of ``python -m parallel_lib.bench sharding --quick``: every variant's row, within 5% of the formula."""

import re

from parallel_lib.bench import sharding
from parallel_lib.bench.__main__ import main as bench_main


def test_quick_sharding_benchmark_prints_every_variant_within_5_percent(capsys):
    assert bench_main(["sharding", "--quick"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("### Sharded data parallelism — model-state bytes per rank and traffic, ")
    for n in (1, 2):
        for variant in sharding.VARIANTS:
            assert f"| tiny | {n} | {variant} | " in out
    assert re.search(r"Census \(mean over ranks\) vs formula, largest deviation: [\d.]+% \(within 5%\)", out)
    assert "| 1 | 31.4 | 31.4 |" in out and "| 3 | 1.9 | 1.9 |" in out
    assert re.search(r"- GPT-2 tiny, 2 ranks: ZeRO-1 saves 3\d% of the model state", out)  # 1 - (2+2+6)/16
