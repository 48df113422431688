"""Benchmarks, run as ``python -m parallel_lib.bench NAME [--quick] ...``.

Benchmarks are kept apart from the tests: a test asserts behaviour, a benchmark
measures the machine it runs on and prints a table to paste into docs/measurements.md (the README links it).
Each ``parallel_lib/bench/NAME.py`` defines ``main(argv) -> int``; the tests only
smoke-run them with ``--quick``.
"""

import argparse
import dataclasses
from typing import Any, Callable, Sequence

__all__ = ["repeats", "parse_config", "REPEATS"]


def repeats(text: str) -> int:
    """The argparse type of every benchmark's ``--repeats``: an int of at least 1.

    argparse names the flag in its error ("argument --repeats: must be >= 1, got 0").
    """
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


# the --repeats option most benchmarks take, for parse_config's ``options``
REPEATS = ("--repeats", {"type": repeats, "help": "timed repeats per variant (the median is reported)"})


def parse_config(argv: Sequence[str] | None, name: str, doc: str, quick: Any, full: Callable[[], Any],
                 quick_help: str, options: Sequence[tuple[str, dict]] = ()) -> tuple[Any, argparse.Namespace]:
    """A benchmark's command line: ``--quick`` picks the smoke-run configuration, and every other option
    that is given replaces the configuration's field of the same name (``--world-size 4`` sets ``world_size``).

    Args:
        argv: the arguments after the benchmark's name.
        name: the benchmark's name (``python -m parallel_lib.bench NAME``).
        doc: the module's docstring (its first line is the description).
        quick: the smoke-run configuration (a dataclass instance).
        full: builds the full configuration.
        quick_help: what ``--quick`` runs.
        options: further ``(flag, argparse keyword arguments)``; an option left out stays None and changes nothing.

    Returns:
        The configuration and the parsed arguments (for options that are not fields).
    """
    parser = argparse.ArgumentParser(prog=f"python -m parallel_lib.bench {name}", description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=quick_help)
    for flag, kwargs in options:
        parser.add_argument(flag, **kwargs)
    args = parser.parse_args(argv)
    config = quick if args.quick else full()
    fields = {field.name for field in dataclasses.fields(config)}
    return dataclasses.replace(config, **{key: value for key, value in vars(args).items()
                                          if key in fields and value is not None}), args
