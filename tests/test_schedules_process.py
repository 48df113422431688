"""The process engine: one gloo rank per pipeline rank runs every schedule and computes the unsplit
model's loss and gradients; the schedules check_blocking refuses are the ones that need deferred sends."""

import pytest
import torch
from torch import nn

from parallel_lib.pipeline_parallel import check_blocking, make_schedule
from parallel_lib.pipeline_parallel.process import ProcessConfig, mlp_and_batch, run_pipeline_ranks
from parallel_lib.runtime.launcher import launch

ALL = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zbv", "dualpipev"]
NEEDS_DEFERRED = {"interleaved", "zbv", "dualpipev"}


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8)])
def test_every_schedule_over_processes_matches_one_process(p, m):
    configs = [ProcessConfig(schedule=name, micro_batches=m, timeout=30, deferred_sends=name in NEEDS_DEFERRED)
               for name in ALL]
    results = launch(run_pipeline_ranks, p, configs, backend="gloo", timeout=120)
    for k, config in enumerate(configs):
        model, x, y = mlp_and_batch(config)
        expected = nn.functional.mse_loss(model(x), y)
        expected.backward()
        loss = sum(results[r][k]["loss"] for r in range(p))
        grads = {name: g for r in range(p) for name, g in results[r][k]["grads"].items()}
        assert loss == pytest.approx(expected.item(), rel=1e-6), config.schedule
        assert sorted(grads) == sorted(name for name, _ in model.named_parameters())
        for name, param in model.named_parameters():
            torch.testing.assert_close(grads[name], param.grad, msg=f"{config.schedule}: {name}")


@pytest.mark.parametrize("name", ALL)
def test_the_schedules_that_need_deferred_sends_are_the_ones_check_blocking_refuses(name):
    schedule = make_schedule(name, 4, 8)
    try:
        check_blocking(schedule)
        refused = False
    except ValueError:
        refused = True
    assert refused == (name in NEEDS_DEFERRED)
