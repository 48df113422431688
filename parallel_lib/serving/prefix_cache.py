"""Prefix caching: a full block of the KV cache is named by the tokens that led to it, so requests can share it.

The keys and values of a block depend on its own tokens *and on every token before it* (attention
mixes the whole prefix into each position). So a block's name is a hash chain::

    h_0 = hash((ROOT, tokens[0 : B]))        h_i = hash((h_{i-1}, tokens[i·B : (i+1)·B]))

Two requests whose first ``i+1`` blocks hold the same tokens get the same ``h_i``, and only then:
a block with the same tokens after a different prefix gets another name. The hash is 64 bits of
BLAKE2b, the same in every process and run (Python's ``hash`` of strings is salted per process), and two
different prefixes share a name with probability about ``2**-64`` per pair. vLLM's automatic prefix
caching names blocks this way (a block's hash covers its tokens and its parent's hash); SGLang keeps a
radix tree of token sequences instead, which finds the same sharing one token at a time.

:class:`PrefixCache` is the table the block manager consults: hash -> block for every full block
whose keys and values are computed, and, among those no request holds any more, the order they were
last released in, so the least recently used one is evicted first when a fresh block is needed.
Only full blocks are named: a partial block still changes as its request decodes.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Optional, Sequence

from parallel_lib.common.checks import positive_int

__all__ = ["ROOT", "block_hashes", "PrefixCache"]

ROOT = 0  # the hash the chain starts from (the "block before the first")


def block_hashes(tokens: Sequence[int], block_size: int, parent: int = ROOT) -> list[int]:
    """The hash chain of the *full* blocks of ``tokens``: one hash per ``block_size`` tokens, a tail left out.

    Args:
        tokens: token ids from the start of the sequence.
        block_size: tokens per block.
        parent: the hash of the block before ``tokens[0]`` (:data:`ROOT` at the start of a sequence).

    Returns:
        ``len(tokens) // block_size`` ints; the ``i``-th names tokens ``0 .. (i+1)·block_size - 1``.

    Raises:
        ValueError: ``block_size`` below 1.
    """
    positive_int("block_size", block_size)
    hashes, h = [], parent
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = ",".join(str(int(t)) for t in tokens[start:start + block_size])
        h = int.from_bytes(hashlib.blake2b(f"{h}:{block}".encode(), digest_size=8).digest(), "little")
        hashes.append(h)
    return hashes


class PrefixCache:
    """Hash -> block of computed full blocks, and the least-recently-released order of the unreferenced ones."""

    def __init__(self) -> None:
        self.block_of: dict[int, int] = {}           # hash -> block holding those keys and values
        self.hash_of: dict[int, int] = {}            # block -> its hash
        self.evictable: OrderedDict[int, None] = OrderedDict()  # blocks no request holds, oldest release first

    def lookup(self, h: int) -> Optional[int]:
        """The block named ``h``, or None."""
        return self.block_of.get(h)

    def register(self, block: int, h: int) -> bool:
        """Name ``block`` by ``h`` once its keys and values are computed; False if ``h`` already names a block."""
        if h in self.block_of or block in self.hash_of:
            return False
        self.block_of[h], self.hash_of[block] = block, h
        return True

    def release(self, block: int) -> bool:
        """The last request holding ``block`` let it go: keep it, evictable, if named; False if it is unnamed."""
        if block not in self.hash_of:
            return False
        self.evictable[block] = None
        return True

    def revive(self, block: int) -> None:
        """A request takes ``block`` again: it is no longer evictable."""
        self.evictable.pop(block, None)

    def evict(self) -> Optional[int]:
        """Forget the least recently released named block and return it (None when none is evictable)."""
        if not self.evictable:
            return None
        block, _ = self.evictable.popitem(last=False)
        del self.block_of[self.hash_of.pop(block)]
        return block
