"""Chapter 13's step layout (one forward pass's batch over the block tables) and the long-tailed request trace.

The layout's tensors are checked value by value on a hand-worked example: two sequences, one with
its blocks out of order, laid out flat and padded (the engine's token-identity tests in
test_paged_serving.py run it end to end).
"""

from __future__ import annotations

import statistics

import pytest

from parallel_lib.serving import poisson_trace, step_layout

# block size 4. Sequence 0: blocks [5, 2], holds tokens 0..4, feeds positions 5 and 6 (slots 9, 10);
# its keys 0..6 live in slots 20 21 22 23 | 8 9 10. Sequence 1: block [1], holds token 0, feeds position 1.
TABLES, TOKENS, STARTS, STOPS = [[5, 2], [1]], [[70, 71], [81]], [5, 1], [7, 2]


def test_the_padded_layout_gives_each_sequence_a_row_and_padding_sees_nothing():
    lay = step_layout(TABLES, TOKENS, STARTS, STOPS, 4, flat=False)
    assert lay.ids.tolist() == [[70, 71], [81, 0]]
    assert lay.valid.tolist() == [[True, True], [True, False]]
    assert lay.positions[lay.valid].tolist() == [5, 6, 1] and lay.write[lay.valid].tolist() == [9, 10, 5]
    assert lay.read[0].tolist() == [20, 21, 22, 23, 8, 9, 10] and lay.read[1, :2].tolist() == [4, 5]
    allowed = lay.allowed[:, 0].int().tolist()
    assert allowed[0] == [[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]]   # causal over its own keys
    assert allowed[1] == [[1, 1, 0, 0, 0, 0, 0], [0] * 7]                 # padding keys unseen, padding query blind
    assert lay.rows.tolist() == [0, 1] and lay.cols.tolist() == [1, 0]


def test_the_flat_layout_puts_every_token_in_one_row_and_masks_the_other_sequences():
    lay = step_layout(TABLES, TOKENS, STARTS, STOPS, 4, flat=True)
    assert lay.ids.tolist() == [[70, 71, 81]] and lay.positions.tolist() == [[5, 6, 1]]
    assert lay.write.tolist() == [[9, 10, 5]] and bool(lay.valid.all())
    assert lay.read.tolist() == [[20, 21, 22, 23, 8, 9, 10, 4, 5]]
    assert lay.allowed[0, 0].int().tolist() == [[1, 1, 1, 1, 1, 1, 0, 0, 0],
                                                [1, 1, 1, 1, 1, 1, 1, 0, 0],
                                                [0, 0, 0, 0, 0, 0, 0, 1, 1]]
    assert lay.rows.tolist() == [0, 0] and lay.cols.tolist() == [1, 2]
    with pytest.raises(ValueError, match="each sequence must feed stop - start >= 1 tokens"):
        step_layout(TABLES, [[70], [81]], STARTS, STOPS, 4, flat=True)


def test_log_uniform_output_lengths_are_mostly_short_with_a_long_tail():
    args = (400, 10.0, (3, 9), (1, 96), 97)
    assert poisson_trace(*args, seed=3) == poisson_trace(*args, seed=3, outputs="uniform")  # the default
    uniform = [a.request.max_new_tokens for a in poisson_trace(*args, seed=3)]
    tail = [a.request.max_new_tokens for a in poisson_trace(*args, seed=3, outputs="log-uniform")]
    assert min(tail) >= 1 and max(tail) <= 96 and max(tail) > 60
    # P(length <= 10) = log(11) / log(97) = 0.52 (uniform: 10 / 96); median about sqrt(97) ~ 10 (uniform: ~48)
    assert 0.42 < sum(t <= 10 for t in tail) / len(tail) < 0.62 and sum(u <= 10 for u in uniform) / 400 < 0.2
    assert 6 <= statistics.median(tail) <= 15 and statistics.median(uniform) > 35
    with pytest.raises(ValueError, match=r"outputs must be one of \['uniform', 'log-uniform'\]"):
        poisson_trace(*args, outputs="zipf")
