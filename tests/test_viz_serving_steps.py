"""Chapter 13's widget: the replay of the engine's step records (each request's state in each step, each block's
owners), its frames and its static image, drawn from the walkthrough's real run.

The records of the first tests are written by hand as the engine writes them: two requests in a pool of 3 blocks
of 2, one preempted and recomputed, a table out of order.
"""

from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402


def _record(step, prefill=(), decode=(), admitted=(), preempted=(), finished=(), tables=None, fed=None, free=0):
    return SimpleNamespace(step=step, prefill=list(prefill), decode=list(decode), admitted=list(admitted),
                           preempted=list(preempted), finished=list(finished), tables=tables or {}, fed=fed or {},
                           free_blocks=free, lengths={})


# two requests in a pool of 3 blocks of 2: r0 grows into a second block, r1 is preempted, r0 ends, r1 returns
_RECORDS = [_record(0, prefill=[0, 1], admitted=[0, 1], tables={0: [0], 1: [1]}, fed={0: 2, 1: 1}, free=1),
            _record(1, decode=[0], preempted=[1], tables={0: [0, 2]}, free=1),
            _record(2, decode=[0], finished=[0], tables={0: [0, 2]}, free=1),
            _record(3, prefill=[1], admitted=[1], tables={1: [2, 0]}, fed={1: 2}, free=1)]


def test_the_replay_reads_each_requests_state_and_each_blocks_owner_from_the_records():
    from parallel_lib.viz.serving_steps import block_owners, serving_step_caption, step_states
    assert step_states(_RECORDS) == {0: ["prefill", "decode", "finished", ""],
                                     1: ["prefill", "preempted", "", "prefill"]}
    assert block_owners(_RECORDS[1], 3) == [[(0, 0)], [], [(0, 1)]]
    assert block_owners(_RECORDS[3], 3) == [[(1, 1)], [], [(1, 0)]]                  # a table out of order
    shared = _record(0, tables={0: [0, 1], 1: [0, 2]})
    assert block_owners(shared, 3)[0] == [(0, 0), (1, 0)]                            # a prefix block, held twice
    assert serving_step_caption(_RECORDS, 1) == ("step 1: prefill none; decode r0; admitted none; preempted r1; "
                                                 "finished none; 1 blocks free")
    assert "prefill r0 (2 tokens), r1 (1 token)" in serving_step_caption(_RECORDS, 0)
    with pytest.raises(ValueError, match="outside a pool of num_blocks=2"):
        block_owners(_RECORDS[1], 2)
    with pytest.raises(ValueError, match="step"):
        serving_step_caption(_RECORDS, 4)
    with pytest.raises(ValueError, match="records must hold"):
        serving_step_caption([], 0)


def test_a_frame_writes_each_blocks_owner_and_the_strip_draws_the_steps_asked_for():
    from parallel_lib.viz.serving_steps import render_serving_step, render_serving_strip
    fig = render_serving_step(_RECORDS, 3, 3)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert [t for t in texts if t.startswith("r") or t == "free"] == ["r1 #1", "free", "r1 #0"]
    plt.close(fig)
    fig = render_serving_step(_RECORDS, 2, 3)                            # r0's last step: its blocks go back
    assert [t.get_text() for t in fig.axes[0].texts if t.get_text().startswith("free")] == ["freed", "free", "freed"]
    plt.close(fig)
    fig = render_serving_strip(_RECORDS, 3, steps=[0, 1])
    assert len(fig.axes) == 3 and fig.axes[1].get_title(loc="left").startswith("step 1: ")
    plt.close(fig)


def test_the_widget_steps_through_the_records():
    pytest.importorskip("ipywidgets")
    from parallel_lib.viz.serving_steps import serving_steps_widget
    widget = serving_steps_widget(_RECORDS, 3)
    caption, slider = widget.children[1], widget.children[0].children[1]
    assert caption.value.startswith("step 0: prefill r0 (2 tokens)") and slider.max == 3
    slider.value = 1
    assert caption.value.startswith("step 1: ") and "preempted r1" in caption.value
    plt.close("all")


def test_the_static_image_replays_the_walkthroughs_real_run(tmp_path):
    from parallel_lib import figures
    from parallel_lib.serving.walkthrough import walkthrough_model, walkthrough_run
    from parallel_lib.viz.serving_steps import step_states
    engine = walkthrough_run(walkthrough_model())
    states = step_states(engine.records)
    assert engine.preemptions == sum(s.count("preempted") for s in states.values()) >= 2
    assert all(s.count("finished") == 1 for s in states.values())          # every request ends once
    assert figures.main(["--static", "--out", str(tmp_path), "--only", "ch13"]) == 0
    assert [p.name for p in tmp_path.glob("*.png")] == ["serving_steps.png"]
    plt.close("all")
