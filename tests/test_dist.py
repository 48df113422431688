"""Tests for parallel_lib.runtime: real gloo ranks on the CPU, their failures, and the torchrun path.

Each launch spawns processes that import torch (~2 s each), so the multi-process
cases are few and cover one behaviour each; failure cases use short timeouts.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import _workers
import pytest
import torch

import parallel_lib.runtime as pdist
from parallel_lib.runtime import LaunchTimeoutError, RankError, RankInfo, launch
from parallel_lib.runtime.environment import main as environment_main


def _live_children() -> list:
    """Processes started by this test process that still exist, zombies included.

    multiprocessing's resource tracker and the fork server ranks are forked from are left out
    (their children, the ranks, are not): each is started once per parent process, on purpose,
    and exits with the parent.
    """
    try:
        import psutil
    except ImportError:  # psutil comes with jupyter; without it, check what multiprocessing knows
        return multiprocessing.active_children()
    tracker = multiprocessing.resource_tracker._resource_tracker._pid
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    return [p for p in psutil.Process().children(recursive=True) if p.pid not in (tracker, server)]


@pytest.fixture(autouse=True)
def no_leftover_processes():
    yield
    assert multiprocessing.active_children() == []
    assert _live_children() == []


@pytest.fixture
def torchrun_env(monkeypatch):
    """The environment torchrun gives a one-rank job, on a free loopback port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


# --- multi-process: gloo ranks on the CPU ------------------------------------------------------

def test_launch_returns_each_ranks_view_in_rank_order(monkeypatch):
    monkeypatch.delenv("PARALLEL_LIB_TEST_MARK", raising=False)
    first = launch(_workers.describe_rank, 3, "a", timeout=60)
    # ranks are forked from a server started by the first launch: they must still see the
    # caller's environment as it is now, as spawned ranks would
    monkeypatch.setenv("PARALLEL_LIB_TEST_MARK", "set after the first launch")
    second = launch(_workers.describe_rank, 2, "b", threads_per_rank=1, timeout=60)  # right after

    assert [r["rank"] for r in first] == [0, 1, 2]
    for rank, seen in enumerate(first):
        assert seen["tag"] == "a" and seen["world_size"] == 3
        assert seen["info"] == RankInfo(rank, 3, rank, 3)
        assert (seen["group_rank"], seen["group_size"]) == (rank, 3)
        assert (seen["backend"], seen["device"], seen["ifname"]) == ("gloo", "cpu", "lo")
        assert seen["threads"] == max(1, pdist.cpu_count() // 3)
        assert seen["master"][0] == "127.0.0.1"
    pids = {seen["pid"] for seen in first}
    assert len(pids) == 3 and os.getpid() not in pids
    assert len({seen["master"] for seen in first}) == 1  # one rendezvous per launch
    assert [(s["rank"], s["tag"], s["threads"]) for s in second] == [(0, "b", 1), (1, "b", 1)]
    assert [s["mark"] for s in first] == [None] * 3
    assert [s["mark"] for s in second] == ["set after the first launch"] * 2


def test_all_reduce_demo_sums_over_ranks():
    results = launch(pdist.all_reduce_demo, 2, timeout=60)

    assert [rank for rank, _, _ in results] == [0, 1]
    for rank, before, after in results:
        torch.testing.assert_close(before, torch.full((2,), float(rank + 1)))
        torch.testing.assert_close(after, torch.full((2,), 3.0))


def test_main_checks_the_setup_with_launched_ranks(capsys):
    assert environment_main(["--world-size", "2", "--timeout", "60"]) == 0
    out = capsys.readouterr().out
    assert "rank 1: [2.0, 2.0] -> all_reduce(SUM) -> [3.0, 3.0]" in out
    assert "all_reduce OK: expected 3 on each of 2 ranks" in out


def test_same_worker_runs_under_torchrun():
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "parallel_lib.runtime", "--timeout", "60"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parent.parent)

    assert done.returncode == 0, done.stderr
    assert done.stdout.count("all_reduce OK: expected 3 on each of 2 ranks") == 1  # rank 0 reports
    assert "rank 1: [2.0, 2.0] -> all_reduce(SUM) -> [3.0, 3.0]" in done.stdout


def test_raising_rank_reaches_caller_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 of 2 raised an exception") as excinfo:
        launch(_workers.raise_on_rank_1, 2, timeout=60)

    assert excinfo.value.ranks == (1,)
    assert "ZeroDivisionError: deliberate failure in rank 1" in excinfo.value.traceback_text
    assert "_workers.py" in str(excinfo.value)  # the rank's own traceback, not the caller's
    assert time.monotonic() - start < 30  # rank 0, blocked in a barrier, was stopped early


def test_hanging_rank_is_stopped_at_the_timeout():
    start = time.monotonic()
    match = r"timed out after 6 s: ranks \[.*1\] of 2"
    with pytest.raises(LaunchTimeoutError, match=match) as excinfo:
        launch(_workers.hang_on_last_rank, 2, timeout=6)

    assert 1 in excinfo.value.ranks
    # the 6 s count from the moment both ranks joined (start-up has its own timeout): stopped right away
    assert 6 <= time.monotonic() - start < 6 + 20


def test_rank_dying_without_exception_reports_exit_code():
    with pytest.raises(RankError, match=r"rank 1 of 2 exited with code 7") as excinfo:
        launch(_workers.exit_on_rank_1, 2, timeout=30)

    assert excinfo.value.exitcode == 7


# --- argument checks (no processes are started) ------------------------------------------------

@pytest.mark.parametrize("world_size", [0, -1, 1.5, True, "2"])
def test_launch_rejects_bad_world_size(world_size):
    with pytest.raises(ValueError, match="world_size"):
        launch(_workers.describe_rank, world_size)


def test_launch_rejects_non_callable_fn():
    with pytest.raises(TypeError, match="fn must be callable"):
        launch("describe_rank", 2)


def test_launch_rejects_fn_that_ranks_cannot_import():
    with pytest.raises(ValueError, match="module-level function"):
        launch(lambda rank, world_size: rank, 2)


def test_launch_rejects_fn_from_a_notebook_cell(monkeypatch):
    def cell_function(rank, world_size):
        return rank
    cell_function.__module__ = "__main__"
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))  # a kernel's
    with pytest.raises(ValueError, match="cell_function' is defined in a notebook cell"):
        launch(cell_function, 2)


@pytest.mark.parametrize("kwargs, name", [(dict(backend="mpi"), "backend"),
                                          (dict(timeout=0), "timeout"),
                                          (dict(threads_per_rank=0), "threads_per_rank")])
def test_launch_rejects_bad_options(kwargs, name):
    with pytest.raises(ValueError, match=name):
        launch(_workers.describe_rank, 2, **kwargs)


def test_nccl_without_gpus_is_a_clear_error():
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has GPUs for NCCL")
    with pytest.raises(ValueError, match="backend='nccl' needs a GPU per rank"):
        pdist.resolve_backend("nccl", 2)
    assert pdist.resolve_backend("auto", 2) == "gloo"


# --- the environment, in one place -------------------------------------------------------------

def test_rank_info_from_env(monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    info = RankInfo.from_env()
    assert info == RankInfo(rank=5, world_size=8, local_rank=1, local_world_size=4)
    assert {key: os.environ[key] for key in info.env()} == info.env()
    assert pdist.is_torchrun()

    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert RankInfo.from_env() == RankInfo(5, 8, 5, 8)  # one host: local = global


@pytest.mark.parametrize("env, match", [(dict(WORLD_SIZE="2"), r"\['RANK'\] are not set"),
                                        (dict(RANK="2", WORLD_SIZE="2"), "RANK must be in"),
                                        (dict(RANK="x", WORLD_SIZE="2"), "must be integers")])
def test_rank_info_rejects_bad_env(monkeypatch, env, match):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=match):
        RankInfo.from_env()


def test_run_torchrun_in_a_one_rank_job(torchrun_env):
    results = pdist.run_torchrun(pdist.all_reduce_demo, timeout=20)

    (rank, before, after), = results
    assert rank == 0
    torch.testing.assert_close(after, before)  # a sum over one rank changes nothing
    assert not torch.distributed.is_initialized()  # the group was left afterwards


def test_run_picks_torchrun_and_checks_world_size(torchrun_env):
    seen, = pdist.run(_workers.describe_rank, None, "t", timeout=20)
    assert (seen["rank"], seen["tag"], seen["pid"]) == (0, "t", os.getpid())  # ran in this process
    with pytest.raises(ValueError, match="world_size=2 but torchrun started 1 ranks"):
        pdist.run(_workers.describe_rank, 2)


def test_run_torchrun_leaves_the_group_when_fn_raises(torchrun_env):
    with pytest.raises(ZeroDivisionError, match="rank 0 fails"):
        pdist.run_torchrun(_raise_zero_division, timeout=20)
    assert not torch.distributed.is_initialized()


def _raise_zero_division(rank, world_size):  # runs in this process: no spawn, so no module needed
    raise ZeroDivisionError(f"rank {rank} fails")


def test_run_outside_torchrun_needs_world_size(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="world_size=None is only allowed under torchrun"):
        pdist.run(_workers.describe_rank, None)


# --- devices and the report --------------------------------------------------------------------

def test_devices_and_rank_device_without_gpus():
    if torch.cuda.is_available():
        pytest.skip("CPU fallback only")
    assert pdist.devices(3) == [torch.device("cpu")] * 3
    assert pdist.rank_device() == torch.device("cpu")
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        pdist.devices(0)


def test_environment_report_and_label(capsys):
    info = pdist.environment_info()
    label = pdist.machine_label(info)
    pdist.environment_report()
    printed = capsys.readouterr().out

    assert info["torch"] == torch.__version__ and info["cpu_count"] >= 1
    assert torch.__version__ in printed and label in printed
    if not info["gpus"]:
        assert label == f"{info['cpu_count']}-core CPU ({info['system']}, no GPU)"
    gpu_info = dict(info, gpus=[("NVIDIA H200", 139.8), ("NVIDIA H200", 139.8)], system="Linux")
    expected = f"2× NVIDIA H200 + {info['cpu_count']}-core CPU (Linux)"
    assert pdist.machine_label(gpu_info) == expected
