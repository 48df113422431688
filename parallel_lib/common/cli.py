"""Command lines from configs: one ``--flag`` per field of a run's config dataclass.

The data-parallel, sharding and tensor-parallel commands all take their options from the
dataclass their worker reads (``RunConfig``, ``TPConfig``), so a new field is a
new flag with the same default, and the command line can never drift from what a notebook passes.
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any, Mapping, Optional, Sequence

__all__ = ["add_config_flags"]


def add_config_flags(parser: argparse.ArgumentParser, config_class: type, skip: Sequence[str] = (),
                     choices: Optional[Mapping[str, Sequence[Any]]] = None,
                     types: Optional[Mapping[str, type]] = None) -> None:
    """Add ``--field-name`` for each field of ``config_class`` (a dataclass with defaults).

    Booleans become ``--flag/--no-flag``; other fields take the type of their default, or
    ``types[name]`` where the default does not tell (None, or an int that may be given as a float).

    Args:
        parser: the parser to extend.
        config_class: the dataclass; its default instance gives every flag's default.
        skip: fields that are not options (set by the program, not the user).
        choices: the allowed values of some fields.
        types: the type of some fields, where their default's type is not it.
    """
    defaults = config_class()
    for f in fields(config_class):
        if f.name in skip:
            continue
        value, flag = getattr(defaults, f.name), "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
        else:
            parser.add_argument(flag, type=(types or {}).get(f.name, type(value)), default=value,
                                choices=(choices or {}).get(f.name))
