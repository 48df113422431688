"""Chapter 11's pictures: the ring-attention replay draws what the record says; the measured plots check their input.

The record here is written by hand as ring attention writes it (block r − t at step t, a send on every
step but the last, tiles 0 for a block wholly in the future of a causal contiguous split); the
notebook and ``figures/ring_attention.png`` replay records of real runs on gloo ranks.
"""

from dataclasses import asdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from parallel_lib.context_parallel import RingEvent  # noqa: E402
from parallel_lib.viz.long_context import plot_attention_memory, plot_rank_work  # noqa: E402
from parallel_lib.viz.ring_attention import (as_events, gathered_record, render_ring_attention,  # noqa: E402
                                             render_ring_attention_strip, ring_attention_caption,
                                             ring_attention_widget)


def _record(cp):
    events = []
    for r in range(cp):
        for t in range(cp):
            block = (r - t) % cp
            events.append(RingEvent("forward", t, r, block, ("kv",) if t < cp - 1 else (), 0 if block > r else 4))
        for t in range(cp):
            block = (r - t) % cp
            sends = (("kv",) if t < cp - 1 else ()) + (("dkv",) if t else ())
            events.append(RingEvent("backward", t, r, block, sends, 0 if block > r else 4))
        events.append(RingEvent("backward", cp, r, (r - cp + 1) % cp, ("dkv",), 0))
    return events


def _texts(fig):
    return [t.get_text() for ax in fig.axes for t in ax.texts]


def test_a_frame_shows_each_ranks_block_its_skipped_work_and_what_it_sent():
    fig = render_ring_attention(_record(4), "forward", 1)
    texts = _texts(fig)
    held_then_sent = ["KV3", "KV3", "KV0", "KV0", "KV1", "KV1", "KV2", "KV2"]
    assert [t for t in texts if t.startswith("KV")] == held_then_sent
    assert sum(t.startswith("skipped") for t in texts) == 1          # rank 0's KV3 is all in the future
    assert "4 tiles\n8 so far" in texts and "skipped: all future\n4 so far" in texts
    plt.close(fig)
    fig = render_ring_attention(_record(4), "backward", 2)            # the accumulator of step 1's block travels
    assert "KV2 + dK,dV of 3" in _texts(fig)
    plt.close(fig)
    fig = render_ring_attention(_record(4), "backward", 4)            # the home step: accumulators only
    assert [t for t in _texts(fig) if "dK" in t] == ["dK,dV of 1", "dK,dV of 2", "dK,dV of 3", "dK,dV of 0"]
    assert "takes its last hop home" in fig.axes[0].get_title()
    plt.close(fig)


def test_bad_frames_and_records_are_refused():
    with pytest.raises(ValueError, match=r"step must be in 0..3 for the forward pass .*got step=4"):
        render_ring_attention(_record(4), "forward", 4)
    with pytest.raises(ValueError, match="direction must be one of"):
        render_ring_attention(_record(2), "sideways", 0)
    with pytest.raises(ValueError, match="every rank's forward steps 0..3"):
        as_events(_record(4)[:5])
    with pytest.raises(ValueError, match="got none"):
        as_events([])
    assert as_events([asdict(e) for e in _record(2)]) == _record(2)   # a launch returns them as dicts
    with pytest.raises(ValueError, match="only ring attention writes a step record"):
        gathered_record([[{"case": {"method": "ulysses"}, "record": []}]], 0)
    plt.close("all")


def test_the_caption_counts_the_tiles_and_names_what_travels():
    caption = ring_attention_caption(_record(2), "forward", 0)
    assert caption == ("forward step 0: every rank attends on the block in hand (8 tiles over all ranks) while "
                       "sending its key/value block to rank r+1")
    backward = ring_attention_caption(_record(2), "backward", 1)
    assert "the dK/dV accumulator of the block it held a step before" in backward


def test_the_strip_draws_every_forward_step_of_every_run():
    fig = render_ring_attention_strip({"cp 2": _record(2), "cp 4": _record(4)}, "title")
    titles = [ax.get_title() for ax in fig.axes if ax.axison is False and ax.get_title()]
    assert titles == [f"cp 2\nforward step {t}" for t in range(2)] + [f"cp 4\nforward step {t}" for t in range(4)]
    plt.close(fig)


def test_the_widget_follows_the_run_and_the_direction():
    pytest.importorskip("ipywidgets")
    widget = ring_attention_widget({"cp 2": _record(2), "cp 4": _record(4)})
    run, direction = widget.children[0].children
    play, frame = widget.children[2].children
    assert frame.max == play.max == 1
    run.value = "cp 4"
    assert frame.max == 3
    direction.value = "backward"
    assert frame.max == 4 and frame.value == 0
    frame.value = 4
    assert "last hop home" in widget.children[1].value
    plt.close("all")


def test_the_measured_plots_check_their_input():
    fig = plot_attention_memory([64, 128], {"full": [1, 4]}, {"full": [1, 4], "tiled": [1, 2]})
    labels = [line.get_label() for line in fig.axes[0].lines]
    assert labels == ["full: formula", "full: tensor census", "tiled: formula"]
    with pytest.raises(ValueError, match="one value per length \\(2\\), got 3 for 'tiled'"):
        plot_attention_memory([64, 128], {}, {"tiled": [1, 2, 3]})
    fig = plot_rank_work({"cp 2": [1, 3], "cp 4": [1, 3, 5, 7]})
    assert len(fig.axes[0].patches) == 6
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["rank 0", "rank 1", "rank 2", "rank 3"]
    with pytest.raises(ValueError, match="at least one"):
        plot_rank_work({})
    plt.close("all")
