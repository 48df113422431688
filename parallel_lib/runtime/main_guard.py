"""A script must start ranks under ``if __name__ == "__main__":``; say so before any rank starts.

Every rank is a fresh process (fork server or spawn) that runs the caller's script again, as
``__mp_main__``, before its job, so that functions defined in the script can be found there.
A ``launch`` at the script's top level (or in a function that the top level calls) then runs
again inside each rank, which multiprocessing refuses while the rank is still starting: every
rank exits with code 1 before it joins the group, and all the caller could say was "a crash
outside Python". :func:`check_main_guard` finds the script line that led to ``launch`` and
refuses it, naming the line, when that line is not under the guard. Notebooks, ``python -c``,
interactive sessions and a package's ``__main__.py`` (``python -m package``), which
multiprocessing never runs again, are not affected.
"""

from __future__ import annotations

import ast
import os
import sys
from types import FrameType
from typing import Optional

__all__ = ["check_main_guard", "unguarded_line"]


def _is_main_test(test: ast.expr) -> bool:
    """``__name__ == "__main__"``, either way round."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return (any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
            and any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides))


def _rerun_in_ranks(main: object, path: str) -> bool:
    """Whether a rank runs this ``__main__`` again, by multiprocessing's own rule (``spawn.get_preparation_data``).

    A package's ``__main__.py`` (``python -m package``) is never run again; a module run with
    ``python -m package.module``, or a script, is.
    """
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None:
        return name != "__main__" and not name.endswith(".__main__")
    return os.path.splitext(os.path.basename(path))[0] != "ipython"


def unguarded_line(frame: Optional[FrameType]) -> Optional[tuple[str, int]]:
    """``(script, line)`` of the main script's top-level line on ``frame``'s stack when no guard encloses it.

    None when ``__main__`` has no script file (a notebook, ``python -c``) or is one that ranks do not
    run again (a package's ``__main__.py``), the script's top level is not on the stack, its source
    cannot be read, or the line is in the body of an ``if __name__ == "__main__":``.
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not _rerun_in_ranks(main, path):
        return None
    script = os.path.realpath(path)
    while frame is not None:
        if (frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)
                and os.path.realpath(frame.f_code.co_filename) == script):
            break
        frame = frame.f_back
    else:
        return None
    try:
        with open(script, encoding="utf-8") as source:
            tree = ast.parse(source.read(), script)
    except (OSError, SyntaxError, ValueError):
        return None
    line = frame.f_lineno
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_main_test(node.test) and node.body:
            if node.body[0].lineno <= line <= (node.body[-1].end_lineno or node.body[-1].lineno):
                return None
    return script, line


def check_main_guard(frame: Optional[FrameType]) -> None:
    """Refuse a launch that the caller's script makes outside ``if __name__ == "__main__":``.

    Args:
        frame: the caller's frame (the stack above it is searched for the script's top level).

    Raises:
        ValueError: naming the script and the line, and saying to move it under the guard.
    """
    found = unguarded_line(frame)
    if found is not None:
        script, line = found
        raise ValueError(
            f"launch was reached from line {line} of {script}, which is not under `if __name__ == \"__main__\":`. "
            "Every rank runs the script again before its job (to find the functions defined there), so each "
            "rank would call launch again and exit with code 1 before it starts; put the lines that launch "
            "ranks (or call a function that does) under `if __name__ == \"__main__\":`")
