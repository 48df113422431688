"""Serving on ranks (chapter 09): dp, pp and tp on two gloo ranks give the single engine's tokens.

One launch runs the three strategies one after another (starting ranks is the slow part);
the checks on each come from the same run. The command line is tested in one process.
"""

from __future__ import annotations

import multiprocessing

import pytest

from parallel_lib.inference import Request, ServeConfig, kv_cache_bytes, serve, serve_many
from parallel_lib.inference.cli import main

# max_batch 2: dp's ranks serve several groups each, and pp has 3 groups in flight on 2 stages
CONFIG = ServeConfig(initializer_range=0.3, max_batch=2)
REQUESTS = [Request([1, 2, 3, 4, 5], 5), Request([7, 8], 4), Request([9, 10, 11, 12, 13, 14, 15, 16], 5),
            Request([3, 500], 5),  # a token id outside the vocabulary of 97: fails alone
            Request([40, 41, 42], 5, temperature=1.0, seed=7), Request([6], 3)]


def test_dp_pp_and_tp_on_two_ranks_give_the_single_engines_tokens():
    runs = serve_many(REQUESTS, ["single", "dp", "pp", "tp"], 2, CONFIG, threads_per_rank=1, timeout=120)
    single = runs["single"]
    n_layer = CONFIG.config().n_layer

    assert single.results[3].error is not None and all(r.ok for i, r in enumerate(single.results) if i != 3)
    for name in ("dp", "pp", "tp"):
        run = runs[name]
        assert run.tokens == single.tokens, name
        assert [r.error for r in run.results] == [r.error for r in single.results], name
    # dp: each rank served its contiguous half of the requests (data.partition's rule), merged in order
    served = [r.served_by for r in runs["dp"].results]
    assert served == ["rank 0"] * 3 + ["", "rank 1", "rank 1"]  # request 3 was refused, by rank 1
    # tp: every forward pass (prefill and each decoded token) is exactly 2 all-reduces per layer, nothing else
    for rank in runs["tp"].ranks:
        decode = [(calls, total) for step, calls, total in rank.collectives if step > 0]
        assert decode and all(calls == total == 2 * n_layer for calls, total in decode)
        assert rank.kv_bytes * 2 == single.ranks[0].kv_bytes  # the cache split by heads
    # pp: each stage holds its 2 layers' cache for every group in flight (3 groups of at most 2)
    config = CONFIG.config()
    head_dim = config.n_embd // config.n_head
    groups = runs["pp"].ranks[0].groups
    assert groups == [[0, 1], [2, 4], [5]]  # request 3 refused on every stage alike
    expected = sum(kv_cache_bytes(2, config.n_head, head_dim, max(REQUESTS[i].slots for i in g), len(g))
                   for g in groups)
    assert [rank.kv_bytes for rank in runs["pp"].ranks] == [expected, expected]
    # pp: 3 groups on 2 stages; every stage ran every group's every step
    steps = sorted((e.micro_batch, e.kind) for e in runs["pp"].ranks[0].events)
    assert steps == sorted((e.micro_batch, e.kind) for e in runs["pp"].ranks[1].events)
    assert {e.micro_batch for e in runs["pp"].ranks[0].events} == {0, 1, 2}
    assert multiprocessing.active_children() == []


def test_the_command_line_serves_and_checks_against_the_single_engine(capsys):
    assert main(["--strategy", "mp", "--world-size", "2", "--prompts", "1 2 3", "4,5", "--max-new-tokens", "3",
                 "--initializer-range", "0.3", "--check"]) == 0
    out = capsys.readouterr().out
    assert "same tokens as the single engine" in out
    expected = serve([Request((1, 2, 3), 3, seed=0), Request((4, 5), 3, seed=1)], "single", 1,
                     ServeConfig(initializer_range=0.3))
    assert f"request 0: {expected.tokens[0]}" in out and f"request 1: {expected.tokens[1]}" in out
    assert "device 1" in out


@pytest.mark.parametrize("argv, message", [
    (["--strategy", "tp", "--world-size", "3"], "n_head=4 is not divisible by the tensor-parallel size tp=3"),
    (["--prompts", "1 x"], "a prompt is token ids separated by spaces or commas"),
    (["--prompts", "1 " * 130], "longer than the model's context n_positions=128"),
    (["--initializer-range", "nan"], "initializer_range must be finite, got initializer_range=nan"),
    (["--initializer-range", "-0.1"], "initializer_range must be >= 0"),
    (["--timeout", "0"], "timeout must be > 0, got timeout=0.0"),
    (["--threads-per-rank", "0"], "threads_per_rank must be an int >= 1"),
    (["--strategy", "dp", "--world-size", "0"], "world_size must be an int >= 1, got world_size=0"),
])
def test_the_command_line_refuses_bad_input_before_any_rank_starts(argv, message, capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(argv)
    assert excinfo.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("steps, p", [([5, 4, 3], 2), ([3, 3], 3), ([4], 2), ([2, 6, 1, 3], 4)])
def test_generation_runs_as_a_forward_only_schedule_whose_exchanges_complete_under_nccl_rules(steps, p):
    """Step t of stage s is model stage t*p + s; the last stage's tokens are stage 0's next input; a finished
    group sends nothing on; the plan the runtime runs passes find_deadlock."""
    from parallel_lib.inference.pipeline import generation_pipeline, generation_schedule
    from parallel_lib.pipeline_parallel.link import find_deadlock, plan_exchanges

    schedule = generation_pipeline(steps, p)
    items = generation_schedule(steps)
    for s in range(p):
        assert [(a.stage, a.micro_batch) for a in schedule.stages[s]] == [(t * p + s, g) for t, g in items]
    plans = plan_exchanges(schedule)
    assert find_deadlock(schedule, plans=plans) is None
    sent = [m for plan in plans for e in plan for m in e.sends]
    tokens = [m for m in sent if m.stage % p == 0]  # the last stage's tokens, back to stage 0
    assert sorted((m.micro_batch, m.stage // p) for m in tokens) == \
        sorted((g, t) for g, n in enumerate(steps) for t in range(1, n))  # every step but a group's first
    assert len(sent) == sum(n * p - 1 for n in steps)  # every hand-over of every step, none after a group's last


def test_every_request_refused_is_a_per_request_error_under_every_strategy():
    refused = [Request([3, 500], 3), Request([97], 2)]  # ids outside the vocabulary of 97
    runs = serve_many(refused, ["single", "mp", "dp", "pp", "tp"], 2, CONFIG, threads_per_rank=1, timeout=120)
    errors = [r.error for r in runs["single"].results]
    assert all(e and "outside the vocabulary 0..96" in e for e in errors)
    for name, run in runs.items():
        assert [r.error for r in run.results] == errors, name
        assert run.tokens == [[], []], name
