"""Classroom faults in ``launch``, tried as a student would: each failed before its fix.

Every launch here has 2 ranks and tiny tensors, and every wait is bounded: a fault
that regresses into a hang fails the test at its timeout instead of stalling the suite.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import types
import warnings
from pathlib import Path

import _fault_workers as workers
import pytest
import torch
import torch.distributed as dist

from parallel_lib.runtime import LaunchTimeoutError, RankError, launch, resolve_backend

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def no_leftover_processes():
    yield
    assert multiprocessing.active_children() == []


@pytest.fixture
def notebook_main(monkeypatch):
    """A ``__main__`` like a Jupyter kernel's (no file to re-import); returns it to define cells in."""
    main = types.ModuleType("__main__")
    monkeypatch.setitem(sys.modules, "__main__", main)
    return main


def _define_in(module: types.ModuleType, obj):
    obj.__module__, obj.__qualname__ = "__main__", obj.__name__
    setattr(module, obj.__name__, obj)
    return obj


# --- the rendezvous store stays on loopback -----------------------------------------------------

@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the socket tables of Linux's /proc")
def test_nothing_listens_beyond_loopback_during_a_launch():
    exposed = launch(workers.exposed_listeners, 2, timeout=30)
    assert exposed == [[], []]


def test_store_listens_where_the_user_asks():
    [seen] = launch(workers.rank_and_value, 1, "x", timeout=30, host="localhost")
    assert seen == (0, "x")
    with pytest.raises(ValueError, match="host"):
        launch(workers.rank_and_value, 1, "x", host="")
    with pytest.raises(ValueError, match=r"host='192\.0\.2\.1' is not an address of this machine"):
        launch(workers.rank_and_value, 1, "x", host="192.0.2.1")  # TEST-NET-1: never a local address


# --- start-up failures name what could not travel -------------------------------------------------

class ScriptConfig:
    """Stands for a config class defined under ``if __name__ == "__main__":`` in a script."""

    value = 3


def test_object_ranks_cannot_import_is_named_with_the_real_traceback(monkeypatch):
    # pickles fine here (this __main__ has it), but a spawned rank's __main__ does not
    _define_in(sys.modules["__main__"], ScriptConfig)
    # a script's __main__ has a file; pytest-xdist's worker has none and would pass for a notebook
    monkeypatch.setattr("parallel_lib.runtime.payload.in_notebook", lambda: False)
    monkeypatch.setattr(ScriptConfig, "__module__", "__main__")
    start = time.monotonic()
    with pytest.raises(RankError, match=r"could not load the job.*'__main__\.ScriptConfig'") as excinfo:
        launch(workers.rank_and_value, 2, ScriptConfig(), timeout=30)
    assert "AttributeError" in excinfo.value.traceback_text
    assert "exited with code" not in str(excinfo.value)
    assert time.monotonic() - start < 30


def test_notebook_config_and_partial_are_refused_before_any_rank_starts(notebook_main):
    class NotebookConfig:
        value = 1

    _define_in(notebook_main, NotebookConfig)
    with pytest.raises(ValueError, match=r"'__main__\.NotebookConfig' is defined in a notebook cell"):
        launch(workers.rank_and_value, 2, NotebookConfig())
    with pytest.raises(ValueError, match=r"'__main__\.NotebookConfig' is defined in a notebook cell"):
        launch(functools.partial(workers.rank_and_value, config=NotebookConfig()), 2)
    with pytest.raises(ValueError, match="NotebookConfig' is defined in a notebook cell"):
        launch(NotebookConfig, 2)  # a class as fn


# --- symptoms explained ---------------------------------------------------------------------------

def test_collective_with_mismatched_sizes_explains_the_abort():
    with pytest.raises(RankError, match="SIGABRT") as excinfo:
        launch(workers.mismatch_variant, 2, "shape", timeout=30)
    message = str(excinfo.value)
    assert "different sizes" in message and "out of memory" not in message


def test_collective_on_some_ranks_names_the_ranks_that_returned():
    with pytest.raises(RankError) as excinfo:
        launch(workers.collective_on_rank_0_only, 2, timeout=20)
    message = str(excinfo.value)
    assert "ranks [1] had already returned" in message
    assert "every rank must make the same collective calls" in message
    assert excinfo.value.returned == (1,)


# --- ranks die with their parent ------------------------------------------------------------------

def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")  # a zombie has ended; only its exit status waits to be read


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="checks processes through /proc")
def test_ranks_exit_when_their_parent_is_killed(tmp_path):
    code = ("import sys; sys.path.insert(0, 'tests'); import _fault_workers as w; "
            "from parallel_lib.runtime import launch\n"
            f"if __name__ == '__main__': launch(w.record_pid_and_sleep, 2, {str(tmp_path)!r}, timeout=120)")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("rank*.pid"))) < 2 and time.monotonic() < deadline:
            assert parent.poll() is None, "the launching process ended early"
            time.sleep(0.2)
        pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
        assert len(pids) == 2, "ranks did not start within 60 s"
        parent.send_signal(signal.SIGKILL)  # as the out-of-memory killer would
        parent.wait(10)
        deadline = time.monotonic() + 10
        while not all(map(_gone, pids)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(map(_gone, pids)), "ranks kept running after their parent died"
    finally:
        parent.kill()
        parent.wait(10)
        for pid_file in tmp_path.glob("rank*.pid"):
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


# --- start-up and run have their own timeouts -----------------------------------------------------

def test_slow_start_up_is_reported_as_start_up():
    start = time.monotonic()
    with pytest.raises(LaunchTimeoutError, match=r"start-up timed out after 2 s: ranks \[0, 1\]") as excinfo:
        launch(workers.rank_and_value, 2, workers.SlowToUnpickle(60), timeout=60, startup_timeout=2)
    assert excinfo.value.phase == "start-up"
    assert time.monotonic() - start < 2 + 10


def test_run_timeout_counts_from_the_moment_all_ranks_joined():
    # a 3 s run timeout, shorter than start-up on a busy machine, still lets the ranks start
    assert launch(workers.sleep_for, 2, 0.1, timeout=3, startup_timeout=60) == [0, 1]
    with pytest.raises(LaunchTimeoutError, match=r"launch timed out after 3 s: ranks \[0, 1\]") as excinfo:
        launch(workers.sleep_for, 2, 60, timeout=3, startup_timeout=60)
    assert excinfo.value.phase == "run"


@pytest.mark.parametrize("kwargs", [dict(timeout=float("inf")), dict(timeout=float("nan")),
                                    dict(startup_timeout=float("inf")), dict(startup_timeout=0)])
def test_non_finite_or_zero_timeouts_are_refused(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        launch(workers.rank_and_value, 2, 0, **kwargs)


# --- backend choice -------------------------------------------------------------------------------

def test_auto_backend_with_too_few_gpus_warns_before_falling_back(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    with pytest.warns(RuntimeWarning, match=r"3 ranks on this host but only 1 GPU"):
        assert resolve_backend("auto", 3) == "gloo"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # enough GPUs, or none at all: nothing to say
        assert resolve_backend("auto", 1) == "nccl"
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
        assert resolve_backend("auto", 3) == "gloo"


# --- a script that launches without `if __name__ == "__main__":` -----------------------------------

def test_a_script_launching_outside_the_main_guard_is_named_before_any_rank_starts(tmp_path):
    """#22: every rank ran the script again and exited with code 1 ("a crash outside Python, os._exit or
    out of memory?"); now the script's line is named and no rank starts."""
    script = tmp_path / "train_script.py"
    script.write_text("import sys; sys.path.insert(0, 'tests'); import _fault_workers as w\n"
                      "from parallel_lib.runtime import launch\n"
                      "\n"
                      "print(launch(w.rank_and_value, 2, 'x', timeout=60))\n")
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"launch was reached from line 4 of {script.resolve()}, which is not under " in done.stderr
    assert "exited with code 1" not in done.stderr and "bootstrapping" not in done.stderr


def _line_seen_by(source: str, path: Path, monkeypatch, name: str = "__main__", spec: str = ""):
    """Run ``source`` as the script ``path`` (this process's ``__main__``, named ``name``) and return what
    ``unguarded_line`` sees from inside each of its ``launch_here()`` calls."""
    from parallel_lib.runtime.main_guard import unguarded_line

    path.write_text(source)
    main = types.ModuleType(name)
    main.__file__ = str(path)
    main.__spec__ = types.SimpleNamespace(name=spec) if spec else None  # python -m spec
    monkeypatch.setitem(sys.modules, "__main__", main)
    seen = []
    vars(main)["launch_here"] = lambda: seen.append(unguarded_line(sys._getframe(1)))
    exec(compile(source, str(path), "exec"), vars(main))
    return seen


@pytest.mark.parametrize("source, name, unguarded", [
    ("launch_here()\n", "__main__", 1),
    ("def main():\n    launch_here()\n\nmain()\n", "__main__", 4),  # a function the top level calls
    ("if __name__ == '__main__':\n    pass\nelse:\n    launch_here()\n", "__mp_main__", 4),  # else: not guarded
    ("def main():\n    launch_here()\n\nif __name__ == '__main__':\n    main()\n", "__main__", None),
    ("if '__main__' == __name__:\n    launch_here()\n", "__main__", None),
])
def test_the_main_guard_is_found_around_the_line_that_leads_to_launch(source, name, unguarded, tmp_path,
                                                                       monkeypatch):
    path = tmp_path / "script.py"
    seen = _line_seen_by(source, path, monkeypatch, name)
    assert seen == [None if unguarded is None else (str(path.resolve()), unguarded)]


@pytest.mark.parametrize("spec, unguarded", [("package.__main__", None), ("package.module", 1)])
def test_python_m_is_checked_as_multiprocessing_runs_it_again(spec, unguarded, tmp_path, monkeypatch):
    """A package's __main__.py (python -m parallel_lib.tensor_parallel) is never run again in a rank."""
    path = tmp_path / "script.py"
    seen = _line_seen_by("launch_here()\n", path, monkeypatch, spec=spec)
    assert seen == [None if unguarded is None else (str(path.resolve()), unguarded)]


def test_a_notebook_or_python_c_has_no_script_to_check(notebook_main):
    from parallel_lib.runtime.main_guard import unguarded_line

    assert unguarded_line(sys._getframe()) is None
