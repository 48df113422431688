"""Dispatch ``python -m parallel_lib.bench NAME [args]`` to ``parallel_lib.bench.NAME.main``."""

from __future__ import annotations

import importlib
import pkgutil
import sys

import parallel_lib.bench as bench_package


def available() -> list[str]:
    """Names of the benchmark modules in this package."""
    return sorted(m.name for m in pkgutil.iter_modules(bench_package.__path__) if not m.name.startswith("_"))


def main(argv: list[str]) -> int:
    names = available()
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: python -m parallel_lib.bench {{{','.join(names)}}} [--quick] [options]")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in names:
        print(f"unknown benchmark {name!r}; choose one of {names}", file=sys.stderr)
        return 2
    return int(importlib.import_module(f"parallel_lib.bench.{name}").main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
