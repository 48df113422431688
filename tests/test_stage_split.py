"""The blocks of each pipeline stage: one rule, the one the runtime builds and the planner prices.

:func:`~parallel_lib.pipeline_parallel.stage_blocks` cuts ``n_layer`` blocks into ``pp`` contiguous
stages, the first ``n_layer % pp`` one block longer (chapter 04's balance). The planner used to
keep its own copy of the rule; here its per-stage parameters are checked against the parameters
of the stages the threaded pipeline really builds (:func:`~parallel_lib.pipeline_parallel.gpt2_stages`),
on splits that do not divide evenly.
"""

from __future__ import annotations

import pytest

from parallel_lib.common.models import build_gpt2
from parallel_lib.pipeline_parallel import gpt2_stages, stage_blocks
from parallel_lib.planner.layout import rank_parameters
from parallel_lib.cost.shape import GPTShape


def test_stage_blocks_gives_the_first_stages_the_remainder():
    assert stage_blocks(5, 2) == [[0, 1, 2], [3, 4]]
    assert stage_blocks(12, 5) == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9], [10, 11]]
    assert stage_blocks(4, 4) == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match=r"pp=3 stages need at least 3 blocks, the model has n_layer=2"):
        stage_blocks(2, 3)
    with pytest.raises(ValueError, match="pp must be"):
        stage_blocks(2, 0)


@pytest.mark.parametrize("n_layer, pp", [(5, 2), (4, 3), (7, 3)])
def test_the_planner_prices_the_stages_the_pipeline_builds(n_layer, pp):
    model = build_gpt2("tiny", 64, 0, n_layer=n_layer, n_embd=32)
    built = [sum(p.numel() for p in stage.parameters()) for stage in gpt2_stages(model, ["cpu"] * pp)]
    # one block of width 32: 12·32² + 13·32 = 12,704 values; the embedding 64·32 + 128·32 = 6,144;
    # the last stage ln_f (64) and its own copy of the tied head (2,048)
    block, last = 12_704, 64 + 2_048
    expected = [len(b) * block for b in stage_blocks(n_layer, pp)]
    expected[0] += 6_144
    expected[-1] += last
    assert built == expected
    shape = GPTShape.of(model.config)
    assert rank_parameters(shape, 1, pp) == built
