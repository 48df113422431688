"""Pipe on CPU threads: same loss and gradients as the sequential module, schedules followed,
backward overlapped, activation counts, failures that reach the caller, no leftover threads."""

import copy
import functools
import gc
import threading
import time

import pytest
import torch
from torch import nn

from parallel_lib.common import build_gpt2, max_concurrency, weighted_cross_entropy
from parallel_lib.pipeline_parallel import THREAD_PREFIX, Pipe, StageError, gpt2_stages, lm_loss, make_schedule

mse = nn.functional.mse_loss


def stage_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]


def mlp(layers=4, width=6):
    torch.manual_seed(1)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)])


def grads(module):
    return {name: p.grad.clone() for name, p in module.named_parameters()}


def assert_same_grads(actual_module, expected_module):
    expected = grads(expected_module)
    for name, grad in grads(actual_module).items():
        torch.testing.assert_close(grad, expected[name], msg=f"gradient of {name}")


@pytest.fixture(autouse=True)
def no_threads_left():
    yield
    if stage_threads():
        gc.collect()  # a Pipe a test dropped stops its workers when it is collected
    assert stage_threads() == []


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("chunks", [1, 3])  # 3: 10 rows split 4 + 3 + 3, more micro-batches than stages
def test_loss_outputs_and_gradients_match_sequential(schedule, stages, chunks):
    model, x, y = mlp(), torch.randn(10, 6), torch.randn(10, 6)
    reference = copy.deepcopy(model)
    expected_loss = mse(reference(x), y)
    expected_loss.backward()
    with Pipe(model, list(range(stages)), chunks=chunks, schedule=schedule) as pipe:
        loss = pipe.train_step(x, y, mse)
        torch.testing.assert_close(pipe(x), reference(x))
    torch.testing.assert_close(loss, expected_loss.detach())
    assert_same_grads(model, reference)


def test_split_size_and_sum_reduction():
    model, x, y = mlp(), torch.randn(10, 6), torch.randn(10, 6)
    reference = copy.deepcopy(model)
    summed = lambda out, target: ((out - target) ** 2).sum()  # noqa: E731
    summed(reference(x), y).backward()
    with Pipe(model, [0, 1], split_size=4) as pipe:  # micro-batches of 4, 4, 2 rows
        pipe.train_step(x, y, summed, reduction="sum")
    assert_same_grads(model, reference)


def test_token_weighted_loss_with_a_tuple_target_matches_the_full_batch():
    model = build_gpt2("tiny", vocab_size=31, n_layer=2)
    reference = copy.deepcopy(model)
    ids, labels = torch.randint(0, 31, (7, 9)), torch.randint(0, 31, (7, 9))
    weights = (torch.rand(7, 9) > 0.4).float()  # a different number of target tokens in every row
    weighted_cross_entropy(reference(ids).logits, labels, weights).backward()
    stages = gpt2_stages(model, [0, 1])
    loss_fn = functools.partial(weighted_cross_entropy, denominator=weights.sum())
    with Pipe(stages, stages.devices, chunks=3) as pipe:
        pipe.train_step(ids, (labels, weights), loss_fn, reduction="sum")
    assert_same_grads(model, reference)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpt2_stages_match_the_tied_model(schedule):
    model = build_gpt2("tiny", vocab_size=61, n_layer=3)
    reference = copy.deepcopy(model)
    ids, labels = torch.randint(0, 61, (5, 12)), torch.randint(0, 61, (5, 12))
    expected_logits = reference(ids).logits
    lm_loss(expected_logits, labels).backward()
    stages = gpt2_stages(model, {"cpu": [0], 1: [1, 2]})
    assert stages.devices == ["cpu", 1] and stages.blocks == [[0], [1, 2]]
    with Pipe(stages, stages.devices, chunks=2, schedule=schedule) as pipe:
        torch.testing.assert_close(pipe(ids), expected_logits)
        loss = pipe.train_step(ids, labels, lm_loss)
        torch.testing.assert_close(loss, lm_loss(expected_logits, labels).detach())
        assert_same_grads(model, reference)  # wte.grad: embedding and head contributions summed
        (wte, head), = stages.tied_parameters
        assert head is not wte
        torch.testing.assert_close(head.grad, reference.transformer.wte.weight.grad)
        pipe.train_step(ids, labels, lm_loss)  # gradients accumulate, still as in the tied model
        lm_loss(reference(ids).logits, labels).backward()
        torch.testing.assert_close(head.grad, reference.transformer.wte.weight.grad)
        assert_same_grads(model, reference)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_executor_follows_the_schedule_and_counts_live_activations(schedule):
    p, m = 3, 5
    with Pipe(mlp(), ["cpu"] * 3, chunks=m, schedule=schedule) as pipe:  # stages may share a device
        pipe.train_step(torch.randn(10, 6), torch.randn(10, 6), mse)
        events = pipe.timeline.events
        expected = make_schedule(schedule, p, m)
        for j, actions in enumerate(expected.stages):
            lane = sorted((e for e in events if e.lane == f"stage {j}"), key=lambda e: e.start)
            assert [("F" if e.kind == "forward" else "B") + str(e.micro_batch) for e in lane] == \
                list(map(str, actions))
        assert pipe.peak_activations == ([m] * p if schedule == "gpipe" else [min(p - j, m) for j in range(p)])


class Sleep(torch.autograd.Function):
    """Identity whose forward and backward sleep: stands in for compute that releases the GIL."""

    @staticmethod
    def forward(ctx, x, seconds):
        time.sleep(seconds)
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class SlowLinear(nn.Linear):
    def forward(self, x):
        return Sleep.apply(super().forward(x), 0.02)


def test_forward_and_backward_overlap_across_stages():
    model = nn.Sequential(SlowLinear(4, 4), SlowLinear(4, 4))
    with Pipe(model, [0, 1], chunks=4) as pipe:
        pipe.train_step(torch.randn(8, 4), torch.randn(8, 4), mse)
        events = pipe.timeline.events
    for kind in ("forward", "backward"):
        assert max_concurrency([e for e in events if e.kind == kind], tolerance=0.002) == 2, kind


class FailOn(nn.Module):
    """Raises in forward (or backward) when it sees the micro-batch whose first value is ``marker``."""

    def __init__(self, marker, in_backward=False):
        super().__init__()
        self.marker, self.in_backward = marker, in_backward
        self.weight = nn.Parameter(torch.ones(()))

    def forward(self, x):
        if not self.in_backward and (x[:, 0] == self.marker).any():
            raise ValueError("boom in forward")
        if self.in_backward and (x[:, 0] == self.marker).any():
            x = x + BackwardFails.apply(x)
        return x * self.weight


class BackwardFails(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.zeros_like(x)

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("boom in backward")


@pytest.mark.parametrize("in_backward, action", [(False, "F2"), (True, "B2")])
def test_a_failing_stage_names_stage_and_micro_batch_and_the_pipe_recovers(in_backward, action):
    model = nn.Sequential(nn.Linear(3, 3), FailOn(marker=100.0, in_backward=in_backward), nn.Linear(3, 3))
    x = torch.randn(8, 3)
    x[5, 0] = 100.0  # row 5 lies in micro-batch 2 of 4
    pipe = Pipe(model, {0: [0], 1: [1, 2]}, chunks=4, schedule="1f1b")
    with torch.no_grad():  # the first layer must pass the marker through unchanged
        model[0].weight.copy_(torch.eye(3))
        model[0].bias.zero_()
    start = time.monotonic()
    with pytest.raises(StageError, match=f"stage 1 failed in {action} \\(micro-batch 2\\)") as info:
        pipe.train_step(x, torch.randn(8, 3), mse)
    assert time.monotonic() - start < 5
    assert isinstance(info.value.__cause__, ValueError)
    frames = []
    tb = info.value.__cause__.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert ("backward" if in_backward else "forward") in frames  # the original traceback is kept
    assert info.value.stage == 1 and str(info.value.action) == action
    assert stage_threads() == []
    x[5, 0] = 0.0
    pipe.train_step(x, torch.randn(8, 3), mse)  # the next call starts fresh workers and works
    assert len(stage_threads()) == 2
    pipe.close()


def test_a_stuck_stage_times_out_instead_of_hanging():
    model = nn.Sequential(nn.Linear(2, 2), SlowLinear(2, 2))
    pipe = Pipe(model, [0, 1], chunks=1, timeout=0.005)
    with pytest.raises(TimeoutError, match="no stage finished a task within timeout=0.005 s"):
        pipe(torch.randn(2, 2))
    for _ in range(100):  # the stuck worker leaves once its 20 ms sleep is over
        if not stage_threads():
            break
        time.sleep(0.01)


def test_grad_mode_reaches_the_workers_and_so_do_intra_op_threads():
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append((torch.is_grad_enabled(), torch.get_num_threads()))
            return x

    model = nn.Sequential(nn.Linear(2, 2), Probe())
    with Pipe(model, [0, 1], chunks=2, num_threads=2) as pipe:
        with torch.no_grad():
            assert not pipe(torch.randn(4, 2)).requires_grad
        out = pipe(torch.randn(4, 2))  # grad enabled: outputs stay attached, backward still works
        out.sum().backward()
        assert model[0].weight.grad is not None
    assert seen == [(False, 2)] * 2 + [(True, 2)] * 2
    assert torch.get_num_threads() == 1  # the caller's setting is untouched


def test_workers_stop_on_close_on_exit_and_when_collected():
    pipe = Pipe(mlp(), [0, 1], chunks=2)
    pipe(torch.randn(4, 6))
    assert stage_threads() == [f"{THREAD_PREFIX}0", f"{THREAD_PREFIX}1"]
    pipe.close()
    assert stage_threads() == []
    pipe(torch.randn(4, 6))
    del pipe
    gc.collect()
    assert stage_threads() == []


def test_bad_arguments_are_named():
    model = mlp(layers=3)
    with pytest.raises(ValueError, match="chunks must be an int >= 1, got chunks=0"):
        Pipe(model, [0, 1], chunks=0)
    with pytest.raises(ValueError, match="give exactly one of chunks or split_size"):
        Pipe(model, [0, 1], chunks=2, split_size=2)
    with pytest.raises(ValueError, match="devices asks for 4 stages but there are only 3 layers"):
        Pipe(model, [0, 1, 2, 3])
    with pytest.raises(ValueError, match="device_map must list layers 0..2"):
        Pipe(model, {0: [0], 1: [2]})
    with pytest.raises(ValueError, match="devices gives no layers to \\[1\\]"):
        Pipe(model, {0: [0, 1, 2], 1: []})
    with pytest.raises(ValueError, match="devices must name at least one device"):
        Pipe(model, [])
    with pytest.raises(TypeError, match="each device must be an int, str or torch.device"):
        Pipe(model, [0, 1.5])
    with pytest.raises(ValueError, match="schedule must be one of"):
        Pipe(model, [0, 1], schedule="zb")
    with pytest.raises(ValueError, match="num_threads must be an int >= 1, got num_threads=0"):
        Pipe(model, [0, 1], num_threads=0)
    with pytest.raises(ValueError, match="timeout must be > 0.*seconds"):
        Pipe(model, [0, 1], timeout=-1)
    with pytest.raises(TypeError, match="module must be an nn.Sequential"):
        Pipe(nn.Linear(2, 2), [0])
    with pytest.raises(ValueError, match="devices asks for 4 stages but there are only 3 blocks"):
        gpt2_stages(build_gpt2("tiny", vocab_size=11, n_layer=3), [0, 1, 2, 3])
    with Pipe(model, [0, 1], chunks=4) as pipe:  # a batch shorter than chunks: see test_pipe_bugs.py
        with pytest.raises(ValueError, match="target must be tensors with 8 rows"):
            pipe.train_step(torch.randn(8, 6), torch.randn(7, 6), mse)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_gpt2_stages_pass_the_mask_by_name_on_every_supported_transformers(attention):
    """Eager attention gets a mask tensor: passed by position it landed in ``cache_position`` on
    transformers 4.53 (``GPT2Block(hidden, past_key_value, cache_position, attention_mask)``)
    and in ``attention_mask`` on 5.x; by name it is the mask on both."""
    model = build_gpt2("tiny", vocab_size=61, n_layer=2)
    model.config._attn_implementation = attention
    ids = torch.randint(0, 61, (3, 10))
    stages = gpt2_stages(model, ["cpu", "cpu"])
    hidden = ids
    for stage in stages:
        hidden = stage(hidden)
    torch.testing.assert_close(hidden, model(ids).logits)
