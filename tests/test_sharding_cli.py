"""``python -m parallel_lib.sharding``: the same run launched by the module and by torchrun prints the same numbers."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = Path(sys.executable).with_name("torchrun")


def _run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)


def _rows(out: str) -> list[list[str]]:
    """The per-rank rows of the printed table, without the tokens/s column (a timing)."""
    return [line.split("|")[1:-2] for line in out.splitlines() if re.match(r"\| \d+ \|", line)]


def test_module_and_torchrun_print_census_and_traffic_equal_to_the_formulas():
    flags = ["--stage", "3", "--collectives", "ring", "--steps", "2", "--vocab-size", "97"]
    launched = _run([sys.executable, "-m", "parallel_lib.sharding", "--world-size", "2", *flags])
    torchrun = _run([str(TORCHRUN), "--nproc-per-node", "2", "-m", "parallel_lib.sharding", *flags])
    assert launched.returncode == 0, launched.stderr[-2000:]
    assert torchrun.returncode == 0, torchrun.stderr[-2000:]
    rows = _rows(launched.stdout)
    assert len(rows) == 2 and rows == _rows(torchrun.stdout)
    assert re.search(r"losses: [\d.]+, [\d.]+", launched.stdout).group() in torchrun.stdout
    for row in rows:  # padding is a few elements: equal to the printed precision
        for cell in row[1:]:
            counted, formula = cell.split(" / ")
            assert float(counted) == pytest.approx(float(formula), rel=0.01), row


def test_a_stage_outside_0_to_3_is_refused_by_the_command_line():
    result = _run([sys.executable, "-m", "parallel_lib.sharding", "--stage", "4"])
    assert result.returncode == 2 and "invalid choice: 4" in result.stderr


@pytest.mark.parametrize("flags, message", [
    (["--world-size", "0"], "--world-size must be an int >= 1, got --world-size=0"),
    (["--world-size", "-1"], "--world-size must be an int >= 1, got --world-size=-1"),
    (["--steps", "0"], "--steps must be an int >= 2, got --steps=0"),
    (["--steps", "1"], "--steps must be an int >= 2, got --steps=1; the census is of the last step"),
    (["--batch-size", "0"], "batch_size must be an int >= 1, got batch_size=0"),
    (["--seq-len", "0"], "seq_len must be an int >= 1, got seq_len=0"),
    (["--batch-size", "3"], "batch_size must split into dp=2 replicas"),
    (["--sync", "fsdp2", "--max-grad-norm", "-1"], "max_grad_norm must be"),
])
def test_counts_that_cannot_run_are_refused_with_the_usage_before_any_rank_starts(flags, message, capsys, monkeypatch):
    """Issue #22 item 8: ``--world-size 0`` ran 2 ranks, ``--steps 0`` or 1 ran 2 steps, ``--batch-size 0`` and
    ``--seq-len 0`` failed inside the ranks."""
    from parallel_lib.runtime import launcher
    from parallel_lib.sharding.cli import main

    monkeypatch.setattr(launcher, "run", lambda *a, **k: pytest.fail("a rank was started"))
    with pytest.raises(SystemExit) as exit_:
        main(flags)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("usage: python -m parallel_lib.sharding")
    assert message in err


def test_the_gpu_check_of_chapter_06_runs_on_cpu_ranks():
    from parallel_lib.gpu_checks.ch06_sharding import check_sharding

    out = check_sharding(2, quick=True)  # gloo ranks on the CPU: the same code as NCCL ranks on GPUs
    for variant in ("ZeRO-0", "ZeRO-3 ring", "ZeRO-3 prefetch", "ZeroRedundancyOptimizer", "FSDP2"):
        assert f"| {variant} | " in out
    assert "match one process" in out and "(within 5%)" in out
