"""The library's plumbing: benchmark dispatch, figure collection, notebook storage."""

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import store_notebook  # noqa: E402


def test_bench_dispatch_lists_and_rejects():
    out = subprocess.run([sys.executable, "-m", "parallel_lib.bench", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "usage" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "parallel_lib.bench", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown benchmark 'nope'" in bad.stderr


def make_notebook():
    nb = nbformat.v4.new_notebook()
    nb.metadata["widgets"] = {"state": {}}
    checked = nbformat.v4.new_code_cell("# NBVAL_CHECK_OUTPUT\nprint(1)", execution_count=3,
                                        outputs=[nbformat.v4.new_output("stream", text="1\n")])
    timing = nbformat.v4.new_code_cell("print(time.time())", execution_count=4,
                                       outputs=[nbformat.v4.new_output("stream", text="17\n")])
    nb.cells = [nbformat.v4.new_markdown_cell("# t"), checked, timing]
    return nb


def test_clean_keeps_only_checked_outputs():
    nb = make_notebook()
    # widget state, the unmarked cell's execution count and its output
    assert len(store_notebook.problems(nb)) == 3
    store_notebook.clean(nb)
    assert store_notebook.problems(nb) == []
    assert nb.cells[1].outputs[0]["text"] == "1\n" and nb.cells[2].outputs == []
    assert (nb.cells[1].execution_count, nb.cells[2].execution_count) == (1, None)  # nbval needs the 1
    assert "widgets" not in nb.metadata


def test_a_marked_cell_without_output_is_reported():
    nb = make_notebook()
    store_notebook.clean(nb)
    nb.cells[1].outputs = []
    assert any("stores no output" in p for p in store_notebook.problems(nb))


def test_every_stored_notebook_is_clean():
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        assert store_notebook.problems(nbformat.read(path, as_version=4)) == [], path.name


def peak_memory(*args):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "peak_memory.py"), *args],
                          capture_output=True, text=True, timeout=120)


def test_peak_memory_fails_a_run_over_its_limit_and_passes_one_under_it():
    hog = [sys.executable, "-c", "import time; x = bytearray(200 * 2**20); time.sleep(1)"]
    over = peak_memory("--limit-gib", "0.1", "--", *hog)
    assert over.returncode == 1 and "OVER the 0.1 GiB limit" in over.stdout
    under = peak_memory("--limit-gib", "4", "--", *hog)
    assert under.returncode == 0 and "within the 4 GiB limit" in under.stdout


def test_peak_memory_passes_on_the_commands_own_failure():
    failing = peak_memory("--limit-gib", "4", "--", sys.executable, "-c", "raise SystemExit(3)")
    assert failing.returncode == 3


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux's proportional set sizes")
def test_peak_memory_counts_pages_shared_by_forked_processes_once():
    # 300 MiB written by a parent, then 3 forked children that only read it: the machine holds
    # it once, while the children's resident sizes each show it again
    shared = [sys.executable, "-c", "import os, time\nx = bytearray(300 * 2**20)\n"
              "pids = [os.fork() or (time.sleep(2), os._exit(0)) for _ in range(3)]\n"
              "[os.waitpid(p, 0) for p in pids]"]
    run = peak_memory("--limit-gib", "0.6", "--", *shared)
    assert run.returncode == 0 and "within the 0.6 GiB limit" in run.stdout, run.stdout
    counted_everywhere = float(run.stdout.split("; ")[1].split(" GiB")[0])
    assert counted_everywhere > 1.0  # 4 x 300 MiB by resident sizes
