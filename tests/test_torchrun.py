"""Scale-out rehearsal: two torchrun "nodes" on loopback train exactly like ``launch``.

The multi-node test starts two separate ``torchrun --nnodes 2 --nproc-per-node 1``
launches that meet through a c10d rendezvous on 127.0.0.1, the way two hosts would
meet at one host's address, and compares their final parameters with the same
data-parallel run started by ``parallel_lib.runtime.launcher``. Both use one thread per
rank and gloo's same two-rank all-reduce, so the parameters must be bit-identical.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from parallel_lib.data_parallel import format_command, torchrun_command
from parallel_lib.training.rehearsal import REHEARSAL, main, train_and_save

ROOT = Path(__file__).resolve().parent.parent
NODE_TIMEOUT_S = 90  # start-up (~5 s of imports per process) plus a few training steps, with room for load


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _session_alive(pgid: int) -> bool:
    """Whether any process of the session/process group ``pgid`` still exists."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _start_node(out: Path, port: int, run_id: str) -> subprocess.Popen:
    command = torchrun_command(2, 1, f"127.0.0.1:{port}", run_id=run_id, module="parallel_lib.training.rehearsal",
                               args=["--out", str(out), "--threads-per-rank", "1", "--timeout", "60"],
                               python=sys.executable, rdzv_conf={"join_timeout": 60})
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    # a session of its own: torchrun's agent and its worker can be killed together as one group
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def test_two_torchrun_nodes_on_loopback_train_exactly_like_launch(tmp_path):
    start = time.monotonic()
    port, run_id = _free_port(), f"rehearsal-{uuid.uuid4().hex[:8]}"
    outs = [tmp_path / f"node{n}.pt" for n in (0, 1)]
    nodes = [_start_node(out, port, run_id) for out in outs]
    logs = []
    try:
        # the reference runs while the nodes start up: launch's two spawned ranks, same config
        expected = train_and_save(REHEARSAL, None, world_size=2, threads_per_rank=1, timeout=60)
        for node in nodes:
            remaining = max(1.0, NODE_TIMEOUT_S - (time.monotonic() - start))
            logs.append(node.communicate(timeout=remaining)[0])
    finally:  # a failure or a timeout above: no torchrun agent or worker may outlive the test
        for node in nodes:
            if _session_alive(node.pid):
                os.killpg(node.pid, signal.SIGKILL)
            node.wait(timeout=10)

    for node, log in zip(nodes, logs):
        assert node.returncode == 0, f"torchrun node failed:\n{log}"
    saved = [torch.load(out) for out in outs]
    assert sorted(s["rank"] for s in saved) == [0, 1]  # c10d may number the nodes either way
    assert all(s["world_size"] == 2 for s in saved)
    assert expected["state"], "the launch reference kept no parameters"
    for s in saved:
        assert s["losses"] == expected["losses"]
        assert s["checksums"] == expected["checksums"]
        assert s["state"].keys() == expected["state"].keys()
        for name, tensor in expected["state"].items():
            torch.testing.assert_close(s["state"][name], tensor, rtol=0, atol=0, msg=f"{name} on rank {s['rank']}")
    assert expected["losses"][-1] < expected["losses"][0], "the rehearsal should train, not just agree"
    assert not any(_session_alive(node.pid) for node in nodes)
    assert multiprocessing.active_children() == []


def test_torchrun_command_for_two_gpu_nodes():
    command = torchrun_command(2, 8, "10.0.0.1:29500", args=["--sync", "ddp"])

    assert format_command(command) == (
        "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29500 "
        "--rdzv-id parallel-llm-course -m parallel_lib.data_parallel --sync ddp")


def test_torchrun_command_through_an_interpreter_with_rendezvous_settings():
    command = torchrun_command(2, 1, "127.0.0.1:1234", run_id="r", module="parallel_lib.training.rehearsal",
                               python="/venv/bin/python", rdzv_conf={"join_timeout": 60, "is_host": 1})

    assert command[:3] == ["/venv/bin/python", "-m", "torch.distributed.run"]
    assert command[command.index("--rdzv-conf") + 1] == "join_timeout=60,is_host=1"
    assert command[-2:] == ["-m", "parallel_lib.training.rehearsal"]
    assert "--node-rank" not in command  # c10d numbers the nodes itself: every node runs this line


@pytest.mark.parametrize("kwargs, match", [
    (dict(nnodes=0), r"nnodes must be an int >= 1, got nnodes=0"),
    (dict(nproc_per_node=True), r"nproc_per_node must be an int >= 1, got nproc_per_node=True"),
    (dict(endpoint="10.0.0.1"), r"endpoint must be HOST:PORT, got endpoint='10.0.0.1'"),
    (dict(endpoint=":29500"), r"endpoint must be HOST:PORT"),
])
def test_torchrun_command_rejects_bad_arguments(kwargs, match):
    arguments = dict(nnodes=2, nproc_per_node=1, endpoint="127.0.0.1:29500") | kwargs
    with pytest.raises(ValueError, match=match):
        torchrun_command(**arguments)


def test_main_rejects_zero_steps(capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["--steps", "0"])
    assert excinfo.value.code == 2
    assert "--steps must be >= 1, got 0" in capsys.readouterr().err
