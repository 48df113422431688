"""Moving one sequence's KV blocks from one engine's pool to another's, over point-to-point messages.

A prefill rank computes a prompt's keys and values into its own pool; a decode rank continues the
request from its own pool (:mod:`.disaggregated`). What travels is exactly the blocks the prompt
used, every layer's keys and values packed into ONE tensor::

    gather_blocks(cache, table)   (layers, 2, n, block_size, heads, head_dim)   [:, 0] keys, [:, 1] values

and the decode rank writes it at the blocks *it* allocated, :func:`scatter_blocks` (its block
ids are its own: block ``table_prefill[j]`` lands in ``table_decode[j]``, a remap, as vLLM's KV
connectors do). Slots past the prompt's last token in the last block travel too (whatever the pool
held there): the receiver's mask never reads them and its next tokens overwrite them.

**The messages.** The receiver must allocate before it receives, so each request travels in two
exchanges, each ONE ``dist.batch_isend_irecv`` (NCCL's rule; no tags, messages between two ranks
match in the order they were posted):

1. a fixed header of :data:`HEADER_FIELDS` int64 values: which request, how it stands after the
   prefill (:data:`CONTINUE`, :data:`DONE`, :data:`FAILED`), its prompt length, its first token and
   when it came (nanoseconds on the run's clock), how many blocks follow, and the byte length of its
   random stream's state;
2. if it continues on the decode rank: the blocks and the request's generator state (its sampled
   tokens then follow the same stream as on one engine: chapter 09's rule).

The sender posts both exchanges and goes on (a prefill rank does not wait for a decode rank to take
its blocks); it waits for them later (:meth:`Posted.wait`). Every tensor is on the device of the
group's backend, every wait is bounded and its failure names the rank and the request
(:func:`~parallel_lib.runtime.waiting.wait_for`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from parallel_lib.runtime.waiting import wait_for
from parallel_lib.serving.paged_kv_cache import PagedKVCache

__all__ = ["CONTINUE", "DONE", "FAILED", "HEADER_FIELDS", "Header", "gather_blocks", "scatter_blocks", "Posted",
           "send_request", "recv_request"]

CONTINUE, DONE, FAILED = 0, 1, 2  # decode on / the first token was the last / the prefill failed (its result says)
HEADER_FIELDS = 7


@dataclass(frozen=True)
class Header:
    """What the receiver needs to know before it allocates (one int64 tensor of :data:`HEADER_FIELDS` on the wire).

    Attributes:
        index: the request's index in the trace.
        status: :data:`CONTINUE` (blocks follow), :data:`DONE` or :data:`FAILED` (nothing follows).
        prompt_len: tokens whose keys and values the blocks hold.
        first_token: the token the prefill sampled (-1 when it failed).
        first_ns: when it was sampled, nanoseconds on the run's clock.
        blocks: blocks that follow.
        state_bytes: bytes of the generator state that follows.
    """

    index: int
    status: int
    prompt_len: int
    first_token: int
    first_ns: int
    blocks: int
    state_bytes: int

    def tensor(self, device: torch.device) -> torch.Tensor:
        return torch.tensor([self.index, self.status, self.prompt_len, self.first_token, self.first_ns, self.blocks,
                             self.state_bytes], dtype=torch.int64, device=device)

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "Header":
        return cls(*(int(v) for v in tensor.tolist()))


def _check_table(cache: PagedKVCache, table: Sequence[int], name: str) -> torch.Tensor:
    ids = torch.as_tensor(list(table), dtype=torch.long)
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= cache.num_blocks:
        raise ValueError(f"{name} must hold block ids in 0..{cache.num_blocks - 1} of the pool, "
                         f"got {name}={list(table)}")
    return ids


def _slot_rows(cache: PagedKVCache, ids: torch.Tensor) -> torch.Tensor:
    """The pool rows (slots) of blocks ``ids``, block by block: (n · block_size,)."""
    bs = cache.block_size
    return (ids[:, None] * bs + torch.arange(bs)).reshape(-1).to(cache.k[cache.layers[0]].device)


def gather_blocks(cache: PagedKVCache, table: Sequence[int]) -> torch.Tensor:
    """A copy of blocks ``table`` of every layer, keys and values: (layers, 2, n, block_size, heads, head_dim).

    Raises:
        ValueError: an empty table or a block id outside the pool.
    """
    ids = _check_table(cache, table, "table")
    rows = _slot_rows(cache, ids)
    shape = (len(ids), cache.block_size, cache.heads, cache.head_dim)
    return torch.stack([torch.stack([cache.k[i].index_select(0, rows).view(shape),
                                     cache.v[i].index_select(0, rows).view(shape)]) for i in cache.layers])


def scatter_blocks(cache: PagedKVCache, table: Sequence[int], blocks: torch.Tensor) -> None:
    """Write ``blocks`` (as :func:`gather_blocks` returns them) at blocks ``table`` of this pool.

    Raises:
        ValueError: a table that does not fit the pool, or ``blocks`` of another shape than
            (layers, 2, len(table), block_size, heads, head_dim).
    """
    ids = _check_table(cache, table, "table")
    shape = (len(cache.layers), 2, len(ids), cache.block_size, cache.heads, cache.head_dim)
    if tuple(blocks.shape) != shape:
        raise ValueError(f"blocks must have shape {shape} (layers, keys/values, len(table), block_size, heads, "
                         f"head_dim) for this pool and table, got {tuple(blocks.shape)}")
    rows = _slot_rows(cache, ids)
    for j, i in enumerate(cache.layers):
        cache.k[i].index_copy_(0, rows, blocks[j, 0].reshape(-1, cache.heads, cache.head_dim))
        cache.v[i].index_copy_(0, rows, blocks[j, 1].reshape(-1, cache.heads, cache.head_dim))


@dataclass
class Posted:
    """One request's sends, posted and not yet waited for (the sender goes on with its next prompt meanwhile).

    Attributes:
        works: each exchange's works with what they are, for the error of a wait that runs out.
        tensors: what they send (kept alive until they are done).
        bytes: bytes sent, headers included.
    """

    works: list[tuple[Any, str]]
    tensors: list[torch.Tensor]
    bytes: int

    def wait(self, timeout: float) -> None:
        """Wait for every send, each at most ``timeout`` seconds (once: gloo hangs on a second wait).

        Raises:
            TimeoutError, RuntimeError: the peer did not receive in time, or failed (naming both ranks and the
                request).
        """
        works, self.works, self.tensors = self.works, [], []
        for work, what in works:
            wait_for(work, timeout, what)


def send_request(header: Header, blocks: Optional[torch.Tensor], state: Optional[torch.Tensor], peer: int,
                 group: Any, device: torch.device, who: str) -> Posted:
    """Post one request's header, then (status :data:`CONTINUE`) its blocks and generator state; wait with
    :meth:`Posted.wait`.

    Args:
        header: the request's header.
        blocks: :func:`gather_blocks` of its prompt's blocks (None unless it continues).
        state: its generator's state, uint8 (None unless it continues).
        peer: the decode rank (global rank).
        group: the process group of this prefill rank and ``peer``.
        device: the device of the group's backend (tensors go there first).
        who: this rank, as errors name it ("rank 0 (prefill)").
    """
    what = f"{who} sending request {header.index}'s"
    head = header.tensor(device)
    works = [(w, f"{what} header to rank {peer}")
             for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, head, peer, group)])]
    tensors = [head]
    if header.status == CONTINUE:
        payload = [blocks.to(device).contiguous(), state.to(device).contiguous()]
        works += [(w, f"{what} {header.blocks} KV blocks to rank {peer}")
                  for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, peer, group) for t in payload])]
        tensors += payload
    return Posted(works, tensors, sum(t.numel() * t.element_size() for t in tensors))


def recv_request(peer: int, group: Any, block_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 timeout: float, who: str) -> tuple[Header, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Receive what :func:`send_request` sent: the header, then (if it continues) the blocks and generator state.

    Args:
        peer: the prefill rank (global rank).
        group: the process group of ``peer`` and this rank.
        block_shape: (layers, 2, block_size, heads, head_dim) of the pool; the blocks arrive as
            (layers, 2, n, block_size, heads, head_dim) with n from the header.
        dtype: the pool's dtype.
        device: the device of the group's backend.
        timeout: seconds each exchange may wait.
        who: this rank, as errors name it ("rank 1 (decode)").

    Returns:
        the header, the blocks (None unless it continues) and the generator state (uint8, on the CPU; None unless
        it continues).

    Raises:
        TimeoutError, RuntimeError: nothing came in time, or the peer failed (naming both ranks).
    """
    head = torch.empty(HEADER_FIELDS, dtype=torch.int64, device=device)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, head, peer, group)]):
        wait_for(work, timeout, f"{who} waiting for a request's header from rank {peer}")
    header = Header.of(head)
    if header.status != CONTINUE:
        return header, None, None
    layers, two, *block = block_shape
    blocks = torch.empty((layers, two, header.blocks, *block), dtype=dtype, device=device)
    state = torch.empty(header.state_bytes, dtype=torch.uint8, device=device)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, peer, group) for t in (blocks, state)]):
        wait_for(work, timeout,
                 f"{who} waiting for request {header.index}'s {header.blocks} KV blocks from rank {peer}")
    return header, blocks, state.cpu()
