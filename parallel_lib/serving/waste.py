"""KV memory held but unused: blocks against chapter 09's ``max_len`` reservation, on the same steps.

Chapter 09's engine gives each request of a batch ``max_len`` slots, the longest request's prompt
plus new tokens, from its first step to the group's last. At a moment when a request holds ``n``
tokens, ``max_len - n`` slots are reserved for nothing (Kwon et al. 2023 measured 60-80 % of KV
memory lost this way, to reservation and fragmentation, in the systems before vLLM). A paged request
holds ``ceil(n / block_size)`` blocks: fewer than ``block_size`` unused slots, in its last block only.

:func:`kv_waste` reads both from the engine's own step records: at every step and for every running
request, the unused slots of its blocks, and what a ``max_len`` row would have left unused at that
same moment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from parallel_lib.common.checks import positive_int

__all__ = ["KVWaste", "kv_waste"]


@dataclass(frozen=True)
class KVWaste:
    """Unused KV slots per running request, averaged over every (step, running request) pair.

    Attributes:
        paged: slots of its blocks beyond its tokens (below ``block_size``).
        reserved: ``max_len`` minus its tokens (chapter 09's row).
        samples: the (step, request) pairs averaged over.
    """

    paged: float
    reserved: float
    samples: int


def kv_waste(records: Sequence, block_size: int, max_len: int) -> KVWaste:
    """Unused slots per running request, paged and reserved (see the module docstring).

    Args:
        records: an engine's :class:`~parallel_lib.serving.engine.StepRecord` list.
        block_size: the pool's block size.
        max_len: the slots chapter 09 reserves per request (its engine's ``max_len``).

    Raises:
        ValueError: no records, or a count below 1.
    """
    positive_int("block_size", block_size), positive_int("max_len", max_len)
    pairs = [(len(r.tables[i]), r.lengths[i]) for r in records for i in r.tables]
    if not pairs:
        raise ValueError("records must hold at least one step with a running request; run the engine first")
    paged = sum(blocks * block_size - n for blocks, n in pairs) / len(pairs)
    reserved = sum(max_len - n for _, n in pairs) / len(pairs)
    return KVWaste(paged, reserved, len(pairs))
