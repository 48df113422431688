"""Benchmarks, run as ``python -m parallel_lib.bench NAME [--quick] ...``.

Benchmarks are kept apart from the tests: a test asserts behaviour, a benchmark
measures the machine it runs on and prints a table to paste into docs/measurements.md (the README links it).
Each ``parallel_lib/bench/NAME.py`` defines ``main(argv) -> int``; the tests only
smoke-run them with ``--quick``.
"""

import argparse

__all__ = ["repeats"]


def repeats(text: str) -> int:
    """The argparse type of every benchmark's ``--repeats``: an int of at least 1.

    argparse names the flag in its error ("argument --repeats: must be >= 1, got 0").
    """
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
