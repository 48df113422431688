"""ZeRO's traffic with micro-batches (issue #21, error 1), checked against the collective counter of real runs.

With gradient accumulation ZeRO-3 gathers every layer group again for each micro-batch's forward
and backward, and ZeRO-2 reduce-scatters each micro-batch's gradients. The formulas used to count
one pass per step whatever the micro-batches (the planner priced ZeRO-3 over 8 sequences at 35.4 GB
per GPU and step for a 6.7B model, where 283.0 GB is right). One launch of 2 ranks trains the tiny
GPT-2 (narrowed to 32 features: no padding over 2 ranks) with 4 micro-batches per replica at every
ZeRO stage; the counter's bytes per mesh axis must equal the cost package's formula and the
planner's collectives, call for call.
"""

from __future__ import annotations

import pytest

from parallel_lib.cost.zero import zero_collectives, zero_passes, zero_traffic
from parallel_lib.model_parallel.memory import MODEL_SHAPES, GiB
from parallel_lib.planner.layout import Layout, dp_collectives, rank_parameters
from parallel_lib.planner.sharded_tensor import zero_option
from parallel_lib.runtime import launch
from parallel_lib.tensor_parallel.cost import GPTShape
from parallel_lib.training import Plan, RunConfig, train_many

M = 4  # micro-batches per replica and step
RUN = RunConfig(n_layer=3, n_embd=32, vocab_size=64, seq_len=8, batch_size=8, steps=2, lr=1e-2, return_state=False,
                timeout=120.0)
SHAPE = GPTShape(3, 32, 4, 64, 128)  # tiny's 4 heads and 128 positions, narrowed
PLANS = [Plan(dp=2, zero=zero, micro_batches=M) for zero in range(4)]


@pytest.fixture(scope="module")
def launched():
    per_rank = launch(train_many, 2, [(plan, RUN) for plan in PLANS], threads_per_rank=1, timeout=300,
                      startup_timeout=300)
    return [[results[k] for results in per_rank] for k in range(len(PLANS))]


def test_one_micro_batch_is_the_zero_papers_volume():
    """Rajbhandari et al. 2020, sec. 7.2: stages 1-2 move 2Ψ per rank like data parallelism, stage 3 3Ψ (1.5×)."""
    psi, n = 1e9, 1024
    assert [zero_traffic(psi, n, stage) / (psi * 2 * (n - 1) / n) for stage in range(4)] == [2, 2, 2, 3]


def test_passes_grow_with_micro_batches_for_stages_2_and_3_only():
    assert [zero_passes(stage, 8) for stage in range(4)] == [2, 2, 9, 24]
    assert zero_collectives([10.0, 6.0], 3, 2) == {"all_gather": (8, 64.0), "reduce_scatter": (4, 32.0)}
    with pytest.raises(ValueError, match="micro_batches"):
        zero_passes(3, 0)
    with pytest.raises(ValueError, match="stage"):
        zero_collectives([1.0], 4)
    with pytest.raises(ValueError, match=r"group_bytes\[1\]"):
        zero_collectives([1.0, -1.0], 2)


@pytest.mark.parametrize("zero", range(4))
def test_the_counter_of_a_run_with_gradient_accumulation_equals_the_formulas(launched, zero):
    results = launched[zero]
    params = rank_parameters(SHAPE)[0]
    assert all(r.parameter_bytes == 4 * params for r in results)  # the planner's count is the run's model
    layout = Layout(dp=2, zero=zero, micro_batches=M, dtype="fp32")
    planned = dp_collectives(layout, params, SHAPE.n_layer)
    for r in results:
        counted = r.traffic["dp"]
        assert {k: c for k, (c, _) in counted.items()} == {k: c for k, (c, _) in planned.items()}, (zero, counted)
        for kind, (_, nbytes) in counted.items():
            assert nbytes == pytest.approx(planned[kind][1], rel=1e-12), (zero, kind)
        # the ring sends (N-1)/N of every pass: 2 for stages 0-1, m + 1 for stage 2, 3m for stage 3
        assert r.wire["dp"] == pytest.approx(zero_traffic(params, 2, zero, "fp32", micro_batches=M), rel=1e-12)
        assert r.wire["dp"] == {0: 2, 1: 2, 2: M + 1, 3: 3 * M}[zero] * (2 - 1) / 2 * 4 * params


def test_the_planner_prices_zero_3_per_sequence():
    """Chapter 06's 6.74B model on 8 GPUs of 16 GiB, 64 sequences: 8 per rank, one at a time.

    Before issue #21 the planner said 35.4 GB per GPU and step for ZeRO-3 (one gather for forward, one for
    backward, one reduce-scatter); each of the 8 sequences makes all three, so 8 x 35.38 = 283.0 GB.
    """
    llama = MODEL_SHAPES["llama-2-7b"]
    option = zero_option(llama, 4096, 64, 16 * GiB, 8)
    assert option.strategy == "ZeRO-3" and option.micro_batches == 8
    assert round(option.allreduce_bytes / 1e9, 1) == 283.0
    assert round(option.allreduce_bytes / 8 / 1e9, 1) == 35.4  # the one-pass figure chapter 06 printed
