"""``python -m parallel_lib.tensor_parallel`` from a shell and under torchrun: it trains, counts, and matches one process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from parallel_lib.tensor_parallel import cli as tp_cli

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["-m", "parallel_lib.tensor_parallel", "--steps", "2", "--check", "--threads-per-rank", "1", "--timeout", "90"]


def _run(command: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["GLOO_SOCKET_IFNAME"] = "lo"  # only loopback
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)


def test_cli_launches_ranks_and_matches_one_process():
    done = _run([sys.executable, *ARGS, "--world-size", "2", "--sequence-parallel"])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "tp=2 dp=1" in done.stdout and ": equal)" in done.stdout and "matches one process" in done.stdout


def test_torchrun_tensor_times_data_parallel_matches_one_process():
    done = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                 *ARGS, "--tp", "2"])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "tp=2 dp=2" in done.stdout and "matches one process" in done.stdout
    assert done.stdout.count("tensor-parallel GPT-2 on") == 1  # printed by rank 0 only


def test_cli_refuses_a_world_size_tp_does_not_divide():
    done = _run([sys.executable, "-m", "parallel_lib.tensor_parallel", "--world-size", "3", "--tp", "2", "--steps", "1",
                 "--timeout", "60"])
    assert done.returncode != 0 and "tp=2 must divide world_size=3" in done.stderr


def test_gpu_check_runs_on_cpu_devices_and_reports_equivalence():
    from parallel_lib.gpu_checks.ch07_tensor_parallel import check_tensor_parallel

    table = check_tensor_parallel(2, quick=True)
    rows = [line for line in table.splitlines() if line.startswith("| 2 | 1 |")]
    assert [row.split(" | ")[2] for row in rows] == ["no", "yes"]
    assert all(float(row.split(" | ")[3]) < 1e-3 for row in rows)


@pytest.mark.parametrize("flags, message", [
    (["--world-size", "0"], "world_size must be an int >= 1, got world_size=0"),  # was replaced by 2
    (["--tp", "-1"], "tp must be an int >= 0, got tp=-1"),
    (["--n-embd", "66"], "n_embd=66 is not divisible by the tiny model's n_head=4"),
    (["--world-size", "3", "--tp", "3"], "tp=3 must divide n_head=4"),
    (["--vocab-size", "129"], "tp=2 must divide vocab_size=129"),
    (["--n-layer", "-1"], "n_layer must be an int >= 0, got n_layer=-1"),  # was a model with no blocks
    (["--dropout", "1.0"], "dropout must be below 1"),
    (["--timeout", "0"], "timeout must be > 0"),
])
def test_values_argparse_accepts_but_no_rank_could_run_are_refused_before_any_rank_starts(flags, message, capsys,
                                                                                         monkeypatch):
    """#22 items 8 and the misleading errors: these failed inside every rank with raw tracebacks."""
    monkeypatch.setattr(tp_cli, "run", lambda *a, **k: pytest.fail("a rank was started"))
    with pytest.raises(SystemExit) as exit_info:
        tp_cli.main(flags)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_check_fails_when_the_training_diverges_to_nan(capsys):
    """#22 item 6: with --lr 1e30 both runs reach NaN, and nan > 3e-4 is False: it printed "matches one process"."""
    assert tp_cli.main(["--world-size", "2", "--lr", "1e30", "--steps", "3", "--check", "--threads-per-rank", "1",
                        "--timeout", "90"]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH: a loss or a parameter is NaN or infinite" in out and "matches one process" not in out
