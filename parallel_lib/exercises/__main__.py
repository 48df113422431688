"""``python -m parallel_lib.exercises``: grade notebooks, write their exercise cells, hide the solutions.

    python -m parallel_lib.exercises grade lab/03_model_parallel.ipynb [...]   # one line per exercise, a score
    python -m parallel_lib.exercises cells notebooks/03_model_parallel.ipynb  # rewrite the exercise section
    python -m parallel_lib.exercises hide-solutions                           # a graded lab: no solutions.py
"""

from __future__ import annotations

import argparse
from pathlib import Path

import nbformat

from parallel_lib.exercises.lab import SECTION_HEADING, _chapter_of, grade_notebook, hide_solutions, section_cells


def write_cells(path: Path) -> None:
    """Replace the notebook's exercise section (from its SECTION_HEADING cell on) with the registry's cells."""
    nb = nbformat.read(path, as_version=4)
    start = next((k for k, c in enumerate(nb.cells) if c.source.startswith(SECTION_HEADING)), len(nb.cells))
    nb.cells = nb.cells[:start] + section_cells(_chapter_of(path))
    nbformat.write(nb, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallel_lib.exercises", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("grade", "grade every exercise of these notebooks"),
                       ("cells", "rewrite these notebooks' exercise cells from the registry")):
        sub.add_parser(name, help=text).add_argument("notebooks", nargs="+", type=Path)
    sub.add_parser("hide-solutions", help="delete solutions.py for a graded lab (git checkout restores it)")
    args = parser.parse_args(argv)
    if args.command == "hide-solutions":
        path = hide_solutions()
        print(f"removed {path}" if path else "solutions.py is already gone")
        return 0
    failures = 0
    for path in args.notebooks:
        if args.command == "cells":
            write_cells(path)
            print(f"{path}: exercise cells written")
            continue
        grades = grade_notebook(path)
        print(f"{path}\n{grades}")
        failures += sum(not r.passed for r in grades)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
