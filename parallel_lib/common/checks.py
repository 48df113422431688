"""Argument checks shared by every module: one message format, one place to test it.

Every public function checks its arguments at the boundary and raises a
``ValueError`` (a bad value) or ``TypeError`` (a wrong kind of object) that names
the argument, shows what it got and, where it helps, says what to do. The checks
here cover the cases that would otherwise be pasted into every module: counts
(``world_size``, ``chunks``, ``n_layers``), finite positive quantities (seconds,
bytes), and a choice among names.

``bool`` is refused wherever an int is expected: ``True`` is an ``int`` in Python,
so ``rank=True`` would otherwise silently mean rank 1.
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any, Iterable, Optional, TypeVar

__all__ = ["check_int", "positive_int", "check_number", "positive_number", "check_choice"]

T = TypeVar("T")


def check_int(name: str, value: Any, minimum: Optional[int] = None, maximum: Optional[int] = None,
              hint: str = "") -> int:
    """``value`` as an int within ``[minimum, maximum]`` (either bound may be None).

    Raises:
        ValueError: not an int (bools, floats such as 2.5 and strings included), or out of range.
    """
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name} must be an int{_range(minimum, maximum)}, got {name}={value!r}"
                         f"{' (' + type(value).__name__ + ')' if not isinstance(value, bool) else ''}{_hint(hint)}")
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be an int{_range(minimum, maximum)}, got {name}={value!r}{_hint(hint)}")
    return value


def positive_int(name: str, value: Any, hint: str = "") -> int:
    """``value`` as an int >= 1 (a count: ranks, stages, micro-batches, layers)."""
    return check_int(name, value, minimum=1, hint=hint)


def check_number(name: str, value: Any, minimum: Optional[float] = None, *, strict: bool = False,
                 hint: str = "") -> float:
    """``value`` as a finite float, at least ``minimum`` (above it when ``strict``).

    Raises:
        ValueError: not a real number, NaN, infinite, or below the bound.
    """
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name} must be a number, got {name}={value!r}{_hint(hint)}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {name}={value!r}{_hint(hint)}")
    if minimum is not None and (number <= minimum if strict else number < minimum):
        bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
        raise ValueError(f"{name} must be {bound}, got {name}={value!r}{_hint(hint)}")
    return number


def positive_number(name: str, value: Any, hint: str = "") -> float:
    """``value`` as a finite float > 0 (seconds, bytes, bandwidths)."""
    return check_number(name, value, 0.0, strict=True, hint=hint)


def check_choice(name: str, value: Any, choices: Iterable[T]) -> T:
    """``value`` if it is one of ``choices``.

    Raises:
        ValueError: naming the valid choices.
    """
    options = list(choices)
    if value not in options:
        raise ValueError(f"{name} must be one of {options}, got {name}={value!r}")
    return value


def _range(minimum: Optional[int], maximum: Optional[int]) -> str:
    if minimum is not None and maximum is not None:
        return f" in {minimum}..{maximum}"
    if minimum is not None:
        return f" >= {minimum}"
    return f" <= {maximum}" if maximum is not None else ""


def _hint(hint: str) -> str:
    return f"; {hint}" if hint else ""
