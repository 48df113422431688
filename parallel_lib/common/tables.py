"""Markdown tables: how benchmarks, the GPU check and the comparisons print their results.

One formatter so that every table in the README and the notebooks has the same shape,
and so that a cell's alignment is declared once per column, not in a pasted separator row.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["markdown_table"]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]], align: str = "") -> str:
    """A GitHub-flavoured markdown table.

    Args:
        header: the column titles.
        rows: one sequence of cells per row (cells are turned into text with ``str``).
        align: one letter per column, ``l`` (left) or ``r`` (right); missing letters mean left.
            E.g. ``"lrr"`` for a name followed by two numbers.

    Raises:
        ValueError: a row with a different number of cells than the header, or an unknown letter in ``align``.
    """
    if not header:
        raise ValueError("header must name at least one column")
    if set(align) - {"l", "r"} or len(align) > len(header):
        raise ValueError(f"align must be at most {len(header)} letters 'l' or 'r', got align={align!r}")
    for i, row in enumerate(rows):
        if len(row) != len(header):
            raise ValueError(f"row {i} has {len(row)} cells for {len(header)} columns: {list(row)!r}")
    marks = ["---:" if a == "r" else "---" for a in align.ljust(len(header), "l")]
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "|".join(marks) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
