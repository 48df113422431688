"""Waiting for one asynchronous send, receive or collective, at most so long, with a failure that says what waited.

A bare ``work.wait()`` waits forever when a peer never comes; gloo's own timeout says only
"Timed out waiting ... for recv" and NCCL's may never fire. Every wait of the library goes
through :func:`wait_for`, which bounds it and names the rank and what it waited for in the
error, so a student sees which rank and which message a hang was about.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

__all__ = ["wait_for"]


def wait_for(work: Any, timeout: float, what: str) -> None:
    """Wait for a send, receive or collective; its failure names what waited for what.

    Args:
        work: what an ``async_op=True`` call or ``dist.batch_isend_irecv`` returned (wait on it once:
            gloo hangs on a second wait).
        timeout: the most seconds to wait.
        what: who waited for what, e.g. ``"rank 3 (stage 1): activation of micro-batch 2 from rank 2"``.

    Raises:
        TimeoutError: nothing came within ``timeout`` seconds.
        RuntimeError: the peer failed first (gloo reports a closed connection).
    """
    start = time.monotonic()
    try:
        work.wait(timedelta(seconds=timeout))
    except RuntimeError as error:
        waited = time.monotonic() - start
        if waited >= 0.99 * timeout:
            raise TimeoutError(f"{what}: nothing within timeout={timeout:g} s ({error})") from error
        raise RuntimeError(f"{what}: failed after {waited:.1f} s ({error})") from error
