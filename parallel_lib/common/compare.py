"""Comparing a run with its reference so that a NaN or an infinity can never pass.

Every check in the course asks whether the largest difference exceeds a tolerance. Written as
``worst > tol``, a NaN answers no (``nan > 3e-4`` is False), and Python's ``max`` drops a NaN
that is not its first argument (``max(0.0, nan)`` is 0.0): a run whose losses or parameters
had gone NaN printed "matches one process". :func:`max_abs_difference` answers ``inf`` as soon
as either side holds a non-finite value, so ``worst > tol`` fails and every ``max`` keeps it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["max_abs_difference"]


def max_abs_difference(got: Any, expected: Any) -> float:
    """The largest ``|got - expected|``, or ``inf`` when either holds a NaN or an infinity.

    Args:
        got, expected: tensors, numbers or sequences of numbers of one shape (``expected`` is
            moved to ``got``'s device).

    Returns:
        The largest absolute difference as a float (0.0 when both are empty), ``inf`` when a value
        of either is not finite.

    Raises:
        ValueError: the two differ in shape.
    """
    a = torch.as_tensor(got).detach()
    b = torch.as_tensor(expected).detach().to(a.device)
    if a.shape != b.shape:
        raise ValueError(f"cannot compare a {tuple(a.shape)} result with a {tuple(b.shape)} reference")
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        return math.inf
    if a.numel() == 0:
        return 0.0
    return float((a - b).abs().max())
