"""Execute course notebooks and store them in their reviewed, diff-friendly form.

    python tools/store_notebook.py notebooks/04_pipeline_parallel.ipynb [...]
    python tools/store_notebook.py --check notebooks/*.ipynb   # exit 1 if not stored cleanly

A stored notebook keeps outputs only in cells marked ``# NBVAL_CHECK_OUTPUT``:
those are the deterministic outputs (schedules, device maps, equivalence checks)
that ``pytest --nbval-lax`` compares on every run. Marked cells keep the execution
count 1, since nbval refuses outputs stored without one ("unrun reference cell"). Everything else (timings, plots,
widget state, execution counts) is dropped: it differs on every machine, bloats
diffs, and saved widget state breaks GitHub's and nbconvert's rendering. Readers
without a kernel see the key figures through images from ``figures/``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

MARK = "# NBVAL_CHECK_OUTPUT"
VOLATILE_NOTEBOOK_METADATA = ("widgets", "varInspector", "toc")
VOLATILE_CELL_METADATA = ("execution", "collapsed", "scrolled", "ExecuteTime")


def clean(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Drop unchecked outputs, execution counts and volatile metadata in place."""
    for key in VOLATILE_NOTEBOOK_METADATA:
        nb.metadata.pop(key, None)
    for cell in nb.cells:
        for key in VOLATILE_CELL_METADATA:
            cell.metadata.pop(key, None)
        if cell.cell_type != "code":
            continue
        if MARK in cell.source:
            cell.execution_count = 1
            cell.outputs = _coalesce_streams(cell.outputs)
            for out in cell.outputs:
                if "execution_count" in out:  # execute_result outputs carry one too
                    out["execution_count"] = 1
        else:
            cell.execution_count = None
            cell.outputs = []
    return nb


def _coalesce_streams(outputs: list) -> list:
    """One output per run of the same stream: how the kernel chunked a cell's prints is not part of it."""
    merged: list = []
    for out in outputs:
        last = merged[-1] if merged else None
        if (out.get("output_type") == "stream" and last is not None and last.get("output_type") == "stream"
                and last.get("name") == out.get("name")):
            last["text"] = last["text"] + out["text"]
        else:
            merged.append(out)
    return merged


def problems(nb: nbformat.NotebookNode) -> list[str]:
    """What keeps a notebook from being stored cleanly (empty when it is)."""
    found = [f"notebook metadata has {k!r}" for k in VOLATILE_NOTEBOOK_METADATA if k in nb.metadata]
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if cell.execution_count is not None and MARK not in cell.source:
            found.append(f"cell {i} has an execution count")
        if cell.outputs and MARK not in cell.source:
            found.append(f"cell {i} stores outputs but is not marked {MARK}")
        if MARK in cell.source and not cell.outputs:
            found.append(f"cell {i} is marked {MARK} but stores no output (run tools/store_notebook.py)")
    return found


def store(path: Path, timeout: int) -> float:
    """Execute ``path`` in its own folder and write the cleaned result back; return seconds taken."""
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    seconds = time.perf_counter() - start
    nbformat.write(clean(nb), path)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--check", action="store_true", help="only report notebooks not stored cleanly")
    parser.add_argument("--timeout", type=int, default=600, help="seconds allowed per cell")
    args = parser.parse_args(argv)
    failed = False
    for path in args.notebooks:
        if args.check:
            found = problems(nbformat.read(path, as_version=4))
            for p in found:
                print(f"{path}: {p}")
            failed |= bool(found)
        else:
            print(f"{path}: executed and stored in {store(path, args.timeout):.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
