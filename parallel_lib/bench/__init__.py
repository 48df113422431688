"""Benchmarks, run as ``python -m parallel_lib.bench NAME [--quick] ...``.

Benchmarks are kept apart from the tests: a test asserts behaviour, a benchmark
measures the machine it runs on and prints a table to paste into the README.
Each ``parallel_lib/bench/NAME.py`` defines ``main(argv) -> int``; the tests only
smoke-run them with ``--quick``.
"""
