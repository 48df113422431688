"""Pipe's recomputation (``checkpoint=``) held to torchgpipe's own tests, written anew: dropout's
random state replayed, recomputation on the ``pipe(x)`` route too, hooks on the partitions on
every route, and the documented double run of an in-place operation."""

import copy
import threading
import time

import pytest
import torch
from torch import nn

from parallel_lib.pipeline_parallel import THREAD_PREFIX, Pipe

mse = nn.functional.mse_loss
CUDA = [pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.fixture(autouse=True)
def no_threads_left():
    yield
    for _ in range(300):
        if not [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]:
            return
        time.sleep(0.01)
    raise AssertionError("a Pipe's stage thread is still running")


class Pair(nn.Module):
    """A layer on (hidden, mask): the mask (no gradient) travels along, as torchgpipe's tuples do."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, pair):
        hidden, mask = pair
        return self.layer(hidden) * mask, mask


def dropout_model(tuples, width=16):
    """Two stages; only the second draws random numbers, so its draws do not depend on the threads' timing."""
    torch.manual_seed(0)
    layers = [nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Dropout(0.5), nn.Linear(width, width)]
    return nn.Sequential(*[Pair(layer) for layer in layers]) if tuples else nn.Sequential(*layers)


def last_hidden(y, target):
    return mse(y[0] if isinstance(y, tuple) else y, target)


def batch(tuples, rows=8, width=16):
    torch.manual_seed(1)
    x, y = torch.randn(rows, width), torch.randn(rows, width)
    mask = (torch.rand(rows, 1) > 0.2).float()
    return ((x, mask) if tuples else x), y


def step(model, checkpoint, schedule, tuples, devices=("cpu", "cpu")):
    x, y = batch(tuples)
    with Pipe(model, list(devices), chunks=4, schedule=schedule, checkpoint=checkpoint) as pipe:
        torch.manual_seed(2)  # the dropout masks' seed
        loss = pipe.train_step(x, y, last_hidden)
        after = torch.rand(3)  # what the generator draws next: recomputation takes nothing from it
    return loss, {name: p.grad for name, p in model.named_parameters()}, after


@pytest.mark.parametrize("tuples", [False, True], ids=["tensor", "tuple"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_recomputed_dropout_gives_the_gradients_of_the_forward_that_was_run(schedule, checkpoint, tuples):
    model = dropout_model(tuples)
    expected_loss, expected, expected_after = step(copy.deepcopy(model), "never", schedule, tuples)
    loss, grads, after = step(model, checkpoint, schedule, tuples)
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=0)
    for name, grad in grads.items():  # before the replay: up to 0.2 apart (other masks in the recomputation)
        torch.testing.assert_close(grad, expected[name], rtol=0, atol=0, msg=name)
    torch.testing.assert_close(after, expected_after, rtol=0, atol=0)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_recomputed_dropout_matches_one_process_run_micro_batch_by_micro_batch(schedule):
    # only the last stage draws, in micro-batch order on every schedule: the plain model run on the
    # micro-batches in order, from the same seed, draws the same masks
    model = dropout_model(tuples=False)
    reference = copy.deepcopy(model)
    loss, grads, _ = step(model, "always", schedule, tuples=False)
    x, y = batch(tuples=False)
    torch.manual_seed(2)
    expected = sum(mse(reference(xi), yi) / 4 for xi, yi in zip(x.chunk(4), y.chunk(4)))
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)


class Scale(nn.Module):
    def __init__(self, value):
        super().__init__()
        self.weight = nn.Parameter(torch.tensor(value))

    def forward(self, x):
        return x * self.weight


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
@pytest.mark.parametrize("device", ["cpu"] + CUDA)
def test_stages_that_share_a_generator_replay_their_own_draws(checkpoint, device):
    # y = x * w0 * mask0 * w1 * mask1 (dropout on both stages, both drawing from one generator while
    # their threads overlap): the loss sum(y) is linear in each weight, so each weight's gradient is
    # exactly loss / weight when backward used the forward's masks, and not otherwise
    w0, w1 = 1.5, 0.5
    model = nn.Sequential(Scale(w0), nn.Dropout(0.5), Scale(w1), nn.Dropout(0.5))
    x = torch.ones(64, 32)
    with Pipe(model, [device, device], chunks=8, schedule="1f1b", checkpoint=checkpoint) as pipe:
        for _ in range(5):
            model.zero_grad()
            loss = pipe.train_step(x, torch.zeros(64, 32), lambda y, t: y.sum() + 0 * t.sum(), reduction="sum")
            torch.testing.assert_close(model[0].weight.grad.cpu() * w0, loss.cpu())
            torch.testing.assert_close(model[2].weight.grad.cpu() * w1, loss.cpu())


class Count(nn.Module):
    """Counts its forward calls (a recomputed micro-batch calls it twice)."""

    def __init__(self, width):
        super().__init__()
        self.linear, self.calls = nn.Linear(width, width), 0

    def forward(self, x):
        self.calls += 1
        return self.linear(x)


@pytest.mark.parametrize("checkpoint, runs", [("never", 4), ("except_last", 7), ("always", 8)])
def test_pipe_call_then_backward_recomputes_as_checkpoint_says(checkpoint, runs):
    torch.manual_seed(0)
    model = nn.Sequential(Count(8), nn.Tanh(), Count(8), nn.Dropout(0.5), Count(8))
    reference = copy.deepcopy(model)
    x = torch.randn(8, 8)
    with Pipe(reference, ["cpu", "cpu"], chunks=4) as pipe:
        torch.manual_seed(3)
        pipe(x).square().sum().backward()
    with Pipe(model, ["cpu", "cpu"], chunks=4, checkpoint=checkpoint) as pipe:
        torch.manual_seed(3)
        pipe(x).square().sum().backward()
    assert [model[k].calls for k in (0, 2, 4)] == [runs] * 3  # 4 micro-batches, each recomputed once
    expected = dict(reference.named_parameters())
    for name, p in model.named_parameters():  # the dropout masks replayed
        torch.testing.assert_close(p.grad, expected[name].grad, rtol=0, atol=0, msg=name)


def test_pipe_call_recomputes_a_tuple_batch():
    model = dropout_model(tuples=True)
    reference = copy.deepcopy(model)
    x, _ = batch(tuples=True)
    for module, checkpoint in ((reference, "never"), (model, "always")):
        with Pipe(module, ["cpu", "cpu"], chunks=4, checkpoint=checkpoint) as pipe:
            calls = [0, 0]
            for s, partition in enumerate(pipe.partitions):
                partition.register_forward_hook(lambda module, args, out, s=s: calls.__setitem__(s, calls[s] + 1))
            torch.manual_seed(3)
            pipe(x)[0].square().sum().backward()
        assert calls == ([8, 8] if checkpoint == "always" else [4, 4])  # recomputed in the backward
    expected = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name].grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "interleaved"])
@pytest.mark.parametrize("checkpoint, per_micro_batch", [("never", 1), ("always", 2)])
def test_forward_hooks_on_the_partitions_fire_on_every_route(schedule, checkpoint, per_micro_batch):
    # torchgpipe calls each partition as a module, in the forward and again in its recomputation:
    # a hook fires once per micro-batch, and once more for each recomputed one
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    with Pipe(model, ["cpu", "cpu"], chunks=4, schedule=schedule, checkpoint=checkpoint) as pipe:
        calls = [0] * len(pipe.partitions)
        seen = [[] for _ in pipe.partitions]
        for s, partition in enumerate(pipe.partitions):
            partition.register_forward_hook(lambda module, args, out, s=s: calls.__setitem__(s, calls[s] + 1))
            partition[0].register_forward_pre_hook(lambda module, args, s=s: seen[s].append(args[0].shape[0]))
        pipe.train_step(x, y, mse)
        assert calls == [4 * per_micro_batch] * len(pipe.partitions)
        assert seen == [[2] * 4 * per_micro_batch] * len(pipe.partitions)  # a layer's hook: its micro-batch
        with torch.no_grad():
            pipe(x)
        assert calls == [4 * per_micro_batch + 4] * len(pipe.partitions)


def test_a_partition_hook_that_changes_the_output_is_trained_through():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    with Pipe(model, ["cpu", "cpu"], chunks=4, schedule="zb-h1") as pipe:
        pipe.partitions[0].register_forward_hook(lambda module, args, out: 2 * out)
        loss = pipe.train_step(x, y, mse)
    expected = mse(reference[2:](2 * reference[:2](x)), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, msg=name)


class AddsToItsInput(nn.Module):
    """``mask.add_(1)`` on an input without gradient: not safe to run twice, and recomputation runs it twice."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(()))

    def forward(self, pair):
        foo, mask = pair
        mask.add_(1)
        return foo * self.weight * mask


@pytest.mark.parametrize("checkpoint, gradient", [("never", 2.0), ("always", 3.0)])
def test_an_in_place_operation_runs_twice_under_recomputation_as_documented(checkpoint, gradient):
    # d(foo * w * (mask + 1)) / dw = 2 at foo = mask = 1; recomputed in train_step, the mask is 3 by
    # the time the gradient is taken; after pipe(x), torch.utils.checkpoint sees its saved input
    # changed and raises. The Pipe's docstring (checkpoint=) says both, as torchgpipe's tests do
    model = nn.Sequential(AddsToItsInput())
    with Pipe(model, ["cpu"], checkpoint=checkpoint) as pipe:
        pipe.train_step((torch.ones(1, 1), torch.ones(1, 1)), torch.zeros(1, 1), lambda y, t: y.sum() + 0 * t.sum(),
                        reduction="sum")
        assert model[0].weight.grad.item() == gradient
        model.zero_grad()
        y = pipe((torch.ones(1, 1), torch.ones(1, 1))).sum()
        if checkpoint == "never":
            y.backward()
            assert model[0].weight.grad.item() == 2.0
        else:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                y.backward()
    doc = " ".join(Pipe.__doc__.split())
    assert "runs twice too, and the gradients then follow the second run" in doc
    assert "modified by an inplace operation" in doc
