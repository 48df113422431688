"""The exercise section of a notebook, grading it in one command, and a graded lab without solutions.

- :func:`section_cells` writes a chapter's exercise cells from the registry (heading, stub cell,
  check cell for each, then one cell that grades them all), so the notebook and the checkers
  cannot drift apart and no heading is cut from a docstring.
- :func:`grade` runs every checker of a chapter on the answers a kernel holds (the notebook's
  last exercise cell calls it); :func:`grade_notebook` does the same for a saved notebook, from a
  terminal: ``python -m parallel_lib.exercises grade lab/03_model_parallel.ipynb``.
- :func:`hide_solutions` removes ``solutions.py`` for a graded lab; checks still run, because
  they compare with the library, never with the solutions.
- :func:`launch_cell` starts ranks that run a function written in a notebook cell.
"""

from __future__ import annotations

import linecache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

from parallel_lib.exercises._core import failed
from parallel_lib.exercises._shipping import ShippedFunction, ship

if TYPE_CHECKING:  # nbformat is imported where a notebook is read or written, not by the grade cell: its import
    import nbformat  # (jsonschema and its validators) takes longer than grading a chapter's exercises

__all__ = ["SECTION_HEADING", "section_cells", "grade", "grade_notebook", "hide_solutions", "launch_cell"]

SECTION_HEADING = "### Self-checking exercises"
TAG = "self-check-exercise"
INTRO = (f"{SECTION_HEADING}\n\nEach exercise below is a cell for your code and a check cell. Fill in the first, run "
         "both: the check prints ✅ with the number of cases it tried, or the first failing case with the expected "
         "and the actual value and a hint. The last cell grades them all at once (from a terminal: "
         "`python -m parallel_lib.exercises grade lab/<notebook>.ipynb`). The reference solutions are in "
         "`parallel_lib/exercises/solutions.py`, unless your teacher removed them for a graded lab: try first, "
         "peek later.")
GRADE_SOURCE = "from parallel_lib.exercises import grade\n\ngrade({chapter!r}, globals())"


def _exercises(chapter: str) -> list:
    from parallel_lib.exercises import EXERCISES
    if chapter not in EXERCISES:
        raise ValueError(f"chapter must be one of {sorted(EXERCISES)}, got chapter={chapter!r}")
    return EXERCISES[chapter]


def section_cells(chapter: str) -> list["nbformat.NotebookNode"]:
    """The notebook cells of ``chapter``'s exercises, from the ``SECTION_HEADING`` cell to the end."""
    import nbformat
    cells = [nbformat.v4.new_markdown_cell(INTRO)]
    for number, item in enumerate(_exercises(chapter), 1):
        if not item.title:
            raise ValueError(f"exercise {item.name!r} has no title to use as its heading")
        cells += [nbformat.v4.new_markdown_cell(f"**Exercise {number}.** {item.title}"),
                  nbformat.v4.new_code_cell(item.stub.rstrip("\n")),
                  nbformat.v4.new_code_cell(item.check_source)]
    cells.append(nbformat.v4.new_code_cell(GRADE_SOURCE.format(chapter=chapter)))
    for cell in cells:  # lets a teacher's tooling find (or strip) the exercise cells
        cell.metadata["tags"] = [TAG]
    return cells


class Grades(list):
    """The results of :func:`grade`; shown as one line per exercise and a score."""

    def __repr__(self) -> str:
        score = sum(result.passed for result in self)
        return "\n".join([*(r.message.splitlines()[0] for r in self), f"score: {score} / {len(self)}"])

    __str__ = __repr__


def grade(chapter: str, namespace: Mapping[str, Any]) -> Grades:
    """Run every checker of ``chapter`` on the answers in ``namespace`` (a kernel's ``globals()``)."""
    results = Grades()
    for item in _exercises(chapter):
        if item.answer_name not in namespace:
            results.append(failed(item.name, None, f"{item.answer_name} is not defined: run its cell first"))
            continue
        try:
            results.append(item.check(namespace[item.answer_name]))
        except TypeError as error:  # a value where a function is due: the checker's only error
            results.append(failed(item.name, None, str(error)))
    return results


def _chapter_of(path: Path) -> str:
    chapter = path.name.split("_")[0]  # "03" of 03_model_parallel.ipynb, "08a" of 08a_...
    _exercises(chapter)  # a ValueError names the chapters when the file name is not "NN_..."
    return chapter


def grade_notebook(path: str | Path) -> Grades:
    """Run a saved notebook's exercise cells (only those) and grade them, as :func:`grade` does in a kernel.

    The stub cells run in a fresh ``__main__``-like namespace with their source kept where
    ``inspect`` finds it (so ``average_token_gradients`` can still be shipped to ranks). An answer cell
    that raises counts as not written.
    """
    import nbformat
    path = Path(path)
    chapter = _chapter_of(path)
    nb = nbformat.read(path, as_version=4)
    names = {item.answer_name for item in _exercises(chapter)}
    try:
        start = next(k for k, c in enumerate(nb.cells) if c.source.startswith(SECTION_HEADING))
    except StopIteration:
        raise ValueError(f"{path} has no {SECTION_HEADING!r} cell") from None
    namespace: dict[str, Any] = {"__name__": "__main__"}
    for number, cell in enumerate(nb.cells[start:]):
        if cell.cell_type != "code" or not any(f"{name}" in cell.source for name in names) or "check_" in cell.source:
            continue
        filename = f"<{path.name}, cell {start + number}>"
        linecache.cache[filename] = (len(cell.source), None, cell.source.splitlines(True), filename)
        try:
            exec(compile(cell.source, filename, "exec"), namespace)  # noqa: S102 - the student's own cell
        except Exception as error:  # noqa: BLE001 - reported as that exercise's failure below
            namespace.pop("__builtins__", None)
            print(f"{filename} raised {type(error).__name__}: {error}")
    return grade(chapter, namespace)


def hide_solutions() -> Optional[Path]:
    """Delete ``solutions.py`` for a graded lab (``git checkout`` brings it back); return its path, or None."""
    path = Path(__file__).with_name("solutions.py")
    if not path.exists():
        return None
    path.unlink()
    return path


def _call_shipped(rank: int, world_size: int, shipped: ShippedFunction, *args: Any) -> Any:
    return shipped.load()(rank, world_size, *args)


def launch_cell(fn: Callable[..., Any], world_size: int, *args: Any, **launch_options: Any) -> list[Any]:
    """``launch(fn, world_size, *args)`` for a ``fn`` written in a notebook cell.

    Spawned ranks import their worker by module and name, and a notebook cell's function lives in
    the kernel's ``__main__``, which they cannot import. This ships the function's source and the
    modules and values it names (see ``_shipping``); it runs as ``fn(rank, world_size, *args)``.
    ``launch_options`` go to :func:`parallel_lib.runtime.launcher.launch` (``timeout``, ``backend``, ...).

    Raises:
        ValueError: ``fn``'s source cannot be read (a lambda); define it with ``def`` in a cell.
    """
    from parallel_lib.runtime.launcher import launch
    return launch(_call_shipped, world_size, ship(fn), *args, **launch_options)
