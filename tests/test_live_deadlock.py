"""The hang for real (issue #21: "gloo buffers sends" was false): two gloo ranks that each send first.

A blocking gloo send waits for the peer's receive even for one element, so both ranks wait until
their group's timeout; the same two messages posted together in one ``batch_isend_irecv`` pass.
One launch runs both (about 2 s of waiting).
"""

from __future__ import annotations

import pytest

from parallel_lib.pipeline_parallel import send_first


@pytest.fixture(scope="module")
def lines():
    return send_first(wait_s=1.5, numel=1)


def test_both_ranks_wait_for_each_other_until_the_timeout(lines):
    unpaired = [line for line in lines if "send, then recv" in line]
    assert len(unpaired) == 2
    for rank, line in enumerate(unpaired):
        assert line.startswith(f"rank {rank}, send, then recv: its send was still waiting for rank {1 - rank}'s")
        assert "s timeout ended it; the recv after it never ran" in line


def test_the_same_messages_paired_in_one_batch_pass(lines):
    paired = [line for line in lines if "batch_isend_irecv" in line]
    assert paired == [f"rank {r}, paired in one batch_isend_irecv: received rank {1 - r}'s 1 value(s)" for r in (0, 1)]


@pytest.mark.parametrize("kwargs, match", [(dict(wait_s=0), "wait_s"), (dict(numel=0), "numel"),
                                           (dict(numel=1.5), "numel")])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        send_first(**kwargs)
