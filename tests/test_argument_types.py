"""#22: bools and floats accepted as counts, and NaN accepted as a size, are named errors.

``True`` is an ``int`` in Python and ``2.0 < 1`` is False, so hand-written checks let
``repeat=True`` mean one pass, ``data=True`` one example and ``n_params=nan`` a NaN memory
estimate; :mod:`parallel_lib.common.checks` refuses them with one message format.
"""

from __future__ import annotations

import pytest
import torch

from parallel_lib.common import build_gpt2
from parallel_lib.common.training import train
from parallel_lib.data.partition import global_batch_indices
from parallel_lib.model_parallel.balance import balance_by_time
from parallel_lib.model_parallel.memory import model_memory, training_memory
from parallel_lib.viz.widgets import figure_panel


@pytest.mark.parametrize("call, match", [
    (lambda: training_memory(float("nan")), "n_params must be finite"),
    (lambda: model_memory("gpt2 (124M)", batch_size=True), "batch_size must be an int >= 0, got batch_size=True"),
    (lambda: model_memory("gpt2 (124M)", batch_size=2.0), r"batch_size must be an int >= 0, got batch_size=2.0"),
    (lambda: global_batch_indices(True, 2, 4), "data must be an int >= 0, got data=True"),
    (lambda: train(torch.nn.Linear(2, 2), None, [], max_steps=True), "max_steps must be a non-negative int"),
    (lambda: figure_panel(lambda: None, {}, per_row=True), "per_row must be an int >= 1, got per_row=True"),
])
def test_bools_floats_and_nan_are_refused_where_counts_and_sizes_are_expected(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_balance_by_time_refuses_a_float_repeat_before_profiling():
    model = build_gpt2("tiny", vocab_size=64)
    with pytest.raises(ValueError, match=r"repeat must be an int >= 1, got repeat=2.0 \(float\)"):
        balance_by_time(model, torch.zeros(1, 4, dtype=torch.long), [0, 1], repeat=2.0)
