"""The block manager: which blocks of the KV pool each sequence owns, like a page table.

The pool holds ``num_blocks`` blocks of ``block_size`` token slots each (:mod:`.paged_kv_cache`).
A sequence owns a *block table*, the list of its blocks in order: token ``t`` lives in block
``table[t // block_size]`` at offset ``t % block_size``. A sequence takes a block when its tokens
fill the last one, never before, so what it holds beyond its tokens is less than one block (the
waste chapter 09's ``max_len`` reservation makes far larger, :mod:`.waste`). Free blocks sit on a
free list; a finished or preempted sequence gives all of its blocks back.

With prefix caching (:mod:`.prefix_cache`) a block can belong to several sequences: each holds a
*reference*, and the block is released when the last one lets it go. A released block whose
tokens are named by the hash chain is kept with its keys and values (a later request with the same
prefix takes it again, without computing it) until a fresh block is needed and none is free: then
the least recently released one is evicted. Only blocks of the first ``len - 1`` tokens are taken
from the cache: the last token is always computed, since its logits give the next token.
"""

from __future__ import annotations

from collections import deque
from typing import Hashable, Sequence

from parallel_lib.common.checks import positive_int
from parallel_lib.serving.prefix_cache import ROOT, PrefixCache, block_hashes

__all__ = ["BlockManager", "blocks_for"]


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold ``tokens`` slots: ``ceil(tokens / block_size)``."""
    return -(-tokens // block_size)


class BlockManager:
    """Block tables, reference counts and the free list of one pool; see the module docstring.

    Args:
        num_blocks: blocks in the pool.
        block_size: token slots per block.
        prefix_caching: share and keep full blocks named by their hash chain.

    Raises:
        ValueError: a count below 1.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False) -> None:
        self.num_blocks = positive_int("num_blocks", num_blocks)
        self.block_size = positive_int("block_size", block_size)
        self.prefix_caching = bool(prefix_caching)
        self.free_list: deque[int] = deque(range(num_blocks))
        self.refs = [0] * num_blocks
        self.tables: dict[Hashable, list[int]] = {}
        self.hashes: dict[Hashable, list[int]] = {}  # the hash chain of each sequence's named blocks
        self.cache = PrefixCache()
        self.hit_blocks = 0     # blocks taken from the prefix cache instead of computed
        self.looked_up = 0      # full prompt blocks looked up in it
        self.evicted = 0        # cached blocks forgotten to make room

    # --- counting -------------------------------------------------------------------------------
    def num_free(self) -> int:
        """Blocks a sequence can take now: the free list and the evictable cached blocks."""
        return len(self.free_list) + len(self.cache.evictable)

    def num_used(self) -> int:
        """Blocks some sequence holds."""
        return self.num_blocks - self.num_free()

    def table(self, seq: Hashable) -> list[int]:
        """The block table of ``seq`` (a copy)."""
        return list(self.tables[seq])

    def _cached(self, tokens: Sequence[int]) -> list[int]:
        """The blocks of the longest cached prefix of ``tokens[:-1]``, in order (none without prefix caching)."""
        if not self.prefix_caching:
            return []
        found = []
        for h in block_hashes(tokens[:-1], self.block_size):
            block = self.cache.lookup(h)
            if block is None:
                break
            found.append(block)
        return found

    def can_allocate(self, tokens: Sequence[int]) -> bool:
        """Whether a sequence of ``tokens`` can get its blocks now (cached ones held by others cost nothing)."""
        cached = self._cached(tokens)
        held = sum(1 for b in cached if self.refs[b] > 0)
        return blocks_for(len(tokens), self.block_size) - held <= self.num_free()

    # --- taking and giving back -----------------------------------------------------------------
    def _fresh(self) -> int:
        if self.free_list:
            return self.free_list.popleft()
        block = self.cache.evict()
        if block is None:
            raise RuntimeError("the block pool is exhausted; check can_allocate / can_append first")
        self.evicted += 1
        return block

    def allocate(self, seq: Hashable, tokens: Sequence[int]) -> int:
        """Give ``seq`` the blocks for ``tokens``; returns how many leading tokens are already computed (cached).

        Raises:
            ValueError: ``seq`` already has blocks, or ``tokens`` is empty.
            RuntimeError: not enough free blocks (ask :meth:`can_allocate` first).
        """
        if seq in self.tables:
            raise ValueError(f"sequence {seq!r} already has blocks; free it before allocating again")
        if not tokens:
            raise ValueError("tokens must hold at least one token")
        if not self.can_allocate(tokens):
            raise RuntimeError(f"{blocks_for(len(tokens), self.block_size)} blocks needed, {self.num_free()} free")
        cached = self._cached(tokens)
        if self.prefix_caching:
            self.looked_up += (len(tokens) - 1) // self.block_size
            self.hit_blocks += len(cached)
        for block in cached:
            self.cache.revive(block)
            self.refs[block] += 1
        table = list(cached)
        while len(table) < blocks_for(len(tokens), self.block_size):
            block = self._fresh()
            self.refs[block] = 1
            table.append(block)
        self.tables[seq] = table
        self.hashes[seq] = block_hashes(tokens[:len(cached) * self.block_size], self.block_size)
        return len(cached) * self.block_size

    def can_append(self, seq: Hashable, length: int) -> bool:
        """Whether ``seq`` can grow to ``length`` tokens now."""
        return blocks_for(length, self.block_size) - len(self.tables[seq]) <= self.num_free()

    def append(self, seq: Hashable, length: int) -> None:
        """Grow ``seq``'s table to hold ``length`` tokens (a block when the last one is full, never before).

        Raises:
            RuntimeError: not enough free blocks (ask :meth:`can_append` first).
        """
        if not self.can_append(seq, length):
            raise RuntimeError(f"sequence {seq!r} needs a block and none is free; preempt a sequence first")
        table = self.tables[seq]
        while len(table) < blocks_for(length, self.block_size):
            block = self._fresh()
            self.refs[block] = 1
            table.append(block)

    def computed(self, seq: Hashable, tokens: Sequence[int], computed: int) -> None:
        """Tell the manager the first ``computed`` of ``seq``'s ``tokens`` have their keys and values in the pool.

        With prefix caching, every block they fill is named by its hash (unless that hash already names
        another block: two sequences computed the same prefix at once, and the first one named keeps it).
        """
        if not self.prefix_caching:
            return
        chain = self.hashes[seq]
        full = computed // self.block_size
        if full > len(chain):
            parent = chain[-1] if chain else ROOT
            chain.extend(block_hashes(tokens[len(chain) * self.block_size:full * self.block_size], self.block_size,
                                      parent))
        table = self.tables[seq]
        for i in range(full):
            self.cache.register(table[i], chain[i])

    def free(self, seq: Hashable) -> None:
        """Give back every block of ``seq`` (last block first: a cached tail is evicted before its prefix).

        Raises:
            KeyError: ``seq`` holds no blocks.
        """
        if seq not in self.tables:
            raise KeyError(f"sequence {seq!r} holds no blocks")
        for block in reversed(self.tables.pop(seq)):
            self._release(block)
        self.hashes.pop(seq, None)

    def truncate(self, seq: Hashable, length: int) -> None:
        """Give back ``seq``'s blocks past the ones that hold ``length`` tokens (a speculative step's lookahead).

        Raises:
            KeyError: ``seq`` holds no blocks.
        """
        if seq not in self.tables:
            raise KeyError(f"sequence {seq!r} holds no blocks")
        table = self.tables[seq]
        while len(table) > blocks_for(length, self.block_size):
            self._release(table.pop())

    def _release(self, block: int) -> None:
        """Drop one reference to ``block``; the last one frees it (or keeps it, evictable, when it is named)."""
        self.refs[block] -= 1
        if self.refs[block] == 0 and not self.cache.release(block):
            self.free_list.append(block)

    @property
    def hit_rate(self) -> float:
        """Prompt blocks taken from the prefix cache / prompt blocks looked up (0.0 before any lookup)."""
        return self.hit_blocks / self.looked_up if self.looked_up else 0.0
