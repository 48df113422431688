"""The hang for real: two ranks that each send before they receive, stopped by a timeout.

The hang gallery (:mod:`.hangs`) refuses broken schedules before they run. This one runs, on a CPU:
with gloo, a blocking ``send`` returns only once the peer has posted the matching receive (gloo
does not buffer it, not even one element), which is what NCCL does with a message larger than its
eager buffer. Two pipeline stages that both send first (an activation forward, a gradient back)
therefore wait for each other until the group's timeout. Posted together in one
``batch_isend_irecv``, the same two messages pass: this is why every exchange in the course's
pipeline runtime is one batch of sends and receives (:mod:`.link`).

Each rank runs the exchange on a group of its own with a short timeout, catches the timeout, and
reports it, so the demonstration ends in seconds and nothing is left waiting.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from parallel_lib.common.checks import positive_int, positive_number
from parallel_lib.runtime.guard import allow_bare_p2p
from parallel_lib.runtime.launcher import launch

__all__ = ["exchange_both_ways", "send_first_rank", "send_first"]


def exchange_both_ways(rank: int, group: dist.ProcessGroup, numel: int, paired: bool) -> torch.Tensor:
    """Send ``numel`` values to the other rank of a two-rank ``group`` and receive its ``numel``.

    ``paired=False``: a blocking ``send``, then a blocking ``recv`` (what hangs when both ranks do it);
    ``paired=True``: both posted at once in one ``batch_isend_irecv``.
    """
    peer = dist.get_global_rank(group, 1 - dist.get_rank(group))
    outgoing, incoming = torch.full((numel,), float(rank)), torch.empty(numel)
    if paired:
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, outgoing, peer, group),
                                            dist.P2POp(dist.irecv, incoming, peer, group)]):
            work.wait()
    else:
        with allow_bare_p2p():  # the hang is the point here: the collective guard would refuse a bare send
            dist.send(outgoing, peer, group=group)
            dist.recv(incoming, peer, group=group)
    return incoming


def send_first_rank(rank: int, world_size: int, wait_s: float, numel: int) -> list[str]:
    """One rank of :func:`send_first`: send first (it times out), then the paired exchange (it passes)."""
    lines = []
    for paired in (False, True):
        group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=wait_s))
        how = "paired in one batch_isend_irecv" if paired else "send, then recv"
        try:
            got = exchange_both_ways(rank, group, numel, paired)
        except RuntimeError as error:
            # gloo's timeout, or the peer's: the rank whose timer fires first closes the connection, and
            # the other's send ends with "connection closed by peer". Anything else is a real failure.
            if not any(text in str(error).lower() for text in ("timed out", "connection closed by peer")):
                raise
            lines.append(f"rank {rank}, {how}: its send was still waiting for rank {1 - rank}'s receive "
                         f"when the {wait_s:g} s timeout ended it; the recv after it never ran")
        else:
            lines.append(f"rank {rank}, {how}: received rank {int(got[0].item())}'s {numel} value(s)")
    return lines


def send_first(wait_s: float = 2.0, numel: int = 1) -> list[str]:
    """Two gloo ranks that each send before they receive (they hang until ``wait_s``), then the same paired.

    Returns:
        One line per rank and attempt: the unpaired exchange's timeout, the paired one's delivery.

    Raises:
        ValueError: ``wait_s`` not a positive number, or ``numel`` not an int >= 1.
        RankError: a rank failed with anything but the timeout.
    """
    positive_number("wait_s", wait_s)
    positive_int("numel", numel)
    results = launch(send_first_rank, 2, float(wait_s), numel, backend="gloo", timeout=30 + 4 * wait_s)
    return [line for rank_lines in results for line in rank_lines]
