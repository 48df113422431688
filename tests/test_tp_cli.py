"""``python -m parallel_lib.tensor_parallel`` from a shell and under torchrun: it trains, counts, and matches one process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
