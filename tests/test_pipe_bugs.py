"""Pipe held to a peer's test suite: the defects that ports of torchgpipe's test_bugs,
test_worker and test_microbatch ideas (written anew here) found, one test each, plus the
classroom faults (an interrupted step, a tuple target with the wrong reduction) and bad input."""

import copy
import math
import threading
import time
from collections import OrderedDict

import pytest
import torch
from torch import nn

from parallel_lib.pipeline_parallel import (
    THREAD_PREFIX,
    Action,
    Pipe,
    Schedule,
    StageError,
    Task,
    make_schedule,
    simulate,
    validate_schedule,
)
from parallel_lib.pipeline_parallel import worker as worker_module

mse = nn.functional.mse_loss


def stage_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]


def reference_grads(model, x, y, loss_fn=mse):
    reference = copy.deepcopy(model)
    loss_fn(reference(x), y).backward()
    return {name: p.grad for name, p in reference.named_parameters()}


def assert_grads(model, expected):
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], msg=name)


@pytest.fixture(autouse=True)
def no_threads_left():
    yield
    for _ in range(300):  # leftovers of a timed-out task end on their own, within seconds
        if not stage_threads():
            break
        time.sleep(0.01)
    assert stage_threads() == []


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_an_in_place_first_layer_of_a_stage_trains(schedule):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4), nn.ReLU(inplace=True))
    x, y = torch.randn(6, 4), torch.randn(6, 4)
    expected = reference_grads(model, x, y)
    with Pipe(model, {0: [0], 1: [1, 2], 2: [3]}, chunks=3, schedule=schedule) as pipe:
        pipe.train_step(x, y, mse)
    assert_grads(model, expected)


def test_state_dict_keys_are_the_plain_models_so_a_trained_pipe_loads_back():
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(embed=nn.Linear(3, 4), act=nn.Tanh(), head=nn.Linear(4, 2)))
    plain = copy.deepcopy(model)
    with Pipe(model, [0, 1], chunks=2) as pipe:
        assert list(pipe.state_dict()) == list(plain.state_dict()) == ["embed.weight", "embed.bias", "head.weight",
                                                                       "head.bias"]
        assert [name for name, _ in pipe.named_parameters()] == [name for name, _ in plain.named_parameters()]
        pipe.train_step(torch.randn(4, 3), torch.randn(4, 2), mse)
        with torch.no_grad():
            model.head.weight.add_(1.0)  # "training"
        plain.load_state_dict(pipe.state_dict())
        torch.testing.assert_close(plain.head.weight, model.head.weight)
        pipe.load_state_dict(nn.Sequential(OrderedDict(embed=nn.Linear(3, 4), act=nn.Tanh(),
                                                        head=nn.Linear(4, 2))).state_dict())
        assert pipe.partitions[1][-1] is model.head  # the stages hold the very layers


class SlowThenFail(nn.Module):
    """Counts its calls; the first one raises after a short sleep."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 1:
            time.sleep(0.1)  # the other micro-batches are queued on this stage meanwhile
            raise ValueError("boom")
        return x


def test_after_a_failure_queued_work_is_dropped_not_run():
    failing = SlowThenFail()
    model = nn.Sequential(failing, nn.Linear(2, 2))
    with Pipe(model, [0, 1], chunks=4) as pipe:  # GPipe: F0..F3 are queued on stage 0 at once
        with pytest.raises(StageError, match="stage 0 failed in F0"):
            pipe.train_step(torch.randn(4, 2), torch.randn(4, 2), mse)
        assert failing.calls == 1


def test_moving_a_pipe_is_refused_but_a_dtype_change_is_not():
    with Pipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), [0, 1]) as pipe:
        for move in (lambda: pipe.to("cpu"), lambda: pipe.cpu(), lambda: pipe.cuda(),
                     lambda: pipe.to(torch.device("cpu"), torch.float64), lambda: pipe.to(torch.zeros(1))):
            with pytest.raises(TypeError, match="a Pipe places its stages itself"):
                move()
        pipe.to(torch.float64)
        assert pipe.partitions[1][0].weight.dtype == torch.float64


def test_a_layer_or_parameter_held_twice_is_refused():
    layer = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"holds the same layer twice \(layers 0 and 2\)"):
        Pipe(nn.Sequential(layer, nn.Tanh(), layer), [0, 1])
    other = nn.Linear(2, 2)
    other.weight = layer.weight
    with pytest.raises(ValueError, match=r"holds the same parameter twice \(0.weight and 2.weight\)"):
        Pipe(nn.Sequential(layer, nn.Tanh(), other), [0, 1])


@pytest.mark.parametrize("rows", [1, 3])
def test_a_batch_shorter_than_chunks_runs_with_fewer_micro_batches(rows):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3))
    x, y = torch.randn(rows, 3), torch.randn(rows, 3)
    expected = reference_grads(model, x, y)
    with Pipe(model, [0, 1], chunks=4) as pipe:
        torch.testing.assert_close(pipe(x), model(x))
        pipe.train_step(x, y, mse)
        assert len({e.micro_batch for e in pipe.timeline.events}) == rows
    assert_grads(model, expected)


class Interrupt(nn.Module):
    def forward(self, x):
        raise KeyboardInterrupt


def test_a_base_exception_in_a_worker_is_reported_at_once():
    with Pipe(nn.Sequential(nn.Linear(2, 2), Interrupt()), [0, 1], timeout=30) as pipe:
        start = time.monotonic()
        with pytest.raises(StageError, match="stage 1 failed in F0 .*KeyboardInterrupt") as info:
            pipe(torch.randn(2, 2))
        assert time.monotonic() - start < 5
        assert isinstance(info.value.__cause__, KeyboardInterrupt)


class Sleep(nn.Module):
    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        time.sleep(self.seconds)
        return x


def test_after_a_timeout_the_pipe_refuses_steps_until_its_stuck_threads_end():
    model = nn.Sequential(nn.Linear(2, 2), Sleep(1.5))
    pipe = Pipe(model, [0, 1], timeout=0.2)
    with pytest.raises(TimeoutError, match="timeout=0.2 s"):
        pipe(torch.randn(2, 2))
    with pytest.raises(RuntimeError, match=f"{THREAD_PREFIX}1 .*still running"):
        pipe(torch.randn(2, 2))
    time.sleep(1.5)
    model[1].seconds = 0.0
    pipe(torch.randn(2, 2))  # the leftover has ended: steps run again
    pipe.close()


class SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(1.5)
        return grad


class SlowGrad(nn.Module):
    def forward(self, x):
        return SlowBackward.apply(x)


def test_an_interrupted_step_does_not_corrupt_the_next_one():
    """A kernel interrupt (KeyboardInterrupt in the caller) while a stage runs a long backward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), SlowGrad(), nn.Linear(3, 3))
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    expected = reference_grads(model, x, y)
    pipe = Pipe(model, {0: [0, 1], 1: [2]}, chunks=2)
    answer = pipe._workers.answer
    calls = []

    def interrupted(timeout):  # the interrupt lands while stage 0 runs its slow B1
        calls.append(1)
        if len(calls) == 7:  # after F0 F1 on both stages and B1 B0 on stage 1
            time.sleep(0.1)
            raise KeyboardInterrupt
        return answer(timeout)

    pipe._workers.answer = interrupted
    with pytest.raises(KeyboardInterrupt):
        pipe.train_step(x, y, mse)
    pipe._workers.answer = answer
    model.zero_grad(set_to_none=True)
    pipe.train_step(x, y, mse)  # re-run at once, as a student would
    assert_grads(model, expected)
    pipe.close()


def test_a_tuple_target_with_mean_reduction_is_an_error():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    weighted = lambda out, target, weights: (((out - target) ** 2).sum(1) * weights).sum() / weights.sum()  # noqa
    with Pipe(model, [0, 1], chunks=2) as pipe:
        with pytest.raises(ValueError, match="reduction=\"mean\" with a tuple target"):
            pipe.train_step(torch.randn(4, 2), (torch.randn(4, 2), torch.rand(4)), weighted)


class Masked(nn.Module):
    """Takes and returns (hidden, mask): a layer whose stage hand-over is a tuple with an int tensor."""

    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, inputs):
        hidden, mask = inputs
        return torch.tanh(self.linear(hidden)) * mask.unsqueeze(-1), mask


class Pool(nn.Module):
    def forward(self, inputs):
        hidden, mask = inputs
        return (hidden * mask.unsqueeze(-1)).sum(1), hidden.mean(1)  # two float outputs


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_tuple_inputs_and_outputs_between_stages(schedule):
    torch.manual_seed(0)
    model = nn.Sequential(Masked(4), Masked(4), Pool())
    hidden, mask = torch.randn(6, 5, 4), (torch.rand(6, 5) > 0.3).long()
    y = torch.randn(6, 4)
    loss_fn = lambda out, target: mse(out[0], target) + mse(out[1], target)  # noqa: E731
    expected = reference_grads(model, (hidden, mask), y, loss_fn)
    expected_out = model((hidden, mask))
    with Pipe(model, [0, 1, 2], chunks=3, schedule=schedule) as pipe:
        out = pipe((hidden, mask))
        assert isinstance(out, tuple) and len(out) == 2
        for a, b in zip(out, expected_out):
            torch.testing.assert_close(a, b)
        pipe.train_step((hidden, mask), y, loss_fn)
    assert_grads(model, expected)


def test_devices_given_as_an_int_or_a_string_is_a_type_error():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    for devices in (2, "cpu", torch.device("cpu")):
        with pytest.raises(TypeError, match="devices must be a list of device keys .* or a device map"):
            Pipe(model, devices)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_simulate_refuses_non_finite_costs(bad):
    with pytest.raises(ValueError, match="stage_costs must be .*finite"):
        simulate(make_schedule("gpipe", 2, 2), (1.0, bad))
    with pytest.raises(ValueError, match="stage_costs must be .*finite"):
        simulate(make_schedule("gpipe", 2, 2), [(1.0, 1.0), (bad, 1.0)])


def test_validate_schedule_refuses_zero_stages_or_micro_batches():
    with pytest.raises(ValueError, match="num_stages must be an int >= 1, got num_stages=0"):
        validate_schedule(Schedule("empty", 0, 2, ()))
    with pytest.raises(ValueError, match="num_micro_batches must be an int >= 1, got num_micro_batches=0"):
        validate_schedule(Schedule("empty", 2, 0, ((), ())))


def test_each_stage_is_timed_by_events_on_its_own_device_without_waiting(monkeypatch):
    """GPU timing structure, checked on the CPU: a task stamps CUDA events on its stage's device only,
    and nothing synchronises (waiting would put the stages in lockstep and hide the pipeline's overlap)."""
    from _fake_cuda import install

    cuda = install(monkeypatch)
    gpus = [torch.device("cuda", 0), torch.device("cuda", 1)]
    recorder = worker_module.TimelineRecorder(event_devices=gpus)
    zeros = len(cuda.events)
    task = Task(1, Action("F", 0), lambda: 7, True, recorder, device=gpus[1])
    assert task.run() == 7
    assert cuda.synchronized == ["cuda:0", "cuda:1"]  # the zero only, before the step
    assert [str(e.stream.device) for e in cuda.events[zeros:]] == ["cuda:1"] * 2  # start and end
    (event,) = recorder.events  # read after the step
    assert (event.lane, event.kind, event.micro_batch) == ("stage 1", "forward", 0)
    with pytest.raises(ValueError, match="device=cuda:0 is not timed by this recorder"):
        Task(0, Action("F", 0), lambda: 7, True, worker_module.TimelineRecorder(), device=gpus[0]).run()
    with Pipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), [0, 1]) as pipe:
        assert pipe.timeline._synchronize is None  # no recorder-wide sync of every stage's GPU
        assert pipe.timeline.event_devices == [d for d in pipe.devices if d.type == "cuda"]


def test_scatter_and_gather_handle_tuples_and_short_batches():
    from parallel_lib.pipeline_parallel import gather, scatter
    hidden, mask = torch.arange(10.0).reshape(5, 2), torch.arange(5)
    parts = scatter((hidden, mask), chunks=3)
    assert [tuple(t.size(0) for t in part) for part in parts] == [(2, 2), (2, 2), (1, 1)]
    back = gather(parts)
    assert torch.equal(back[0], hidden) and torch.equal(back[1], mask)
    assert [len(x) for x in scatter(torch.zeros(2, 3), chunks=8)] == [1, 1]  # short batch: one row each
    with pytest.raises(ValueError, match=r"the same number in every tensor, got rows \[5, 4\]"):
        scatter((hidden, mask[:4]), chunks=2)
    with pytest.raises(TypeError, match="batch must be a tensor, or a tuple of tensors"):
        scatter([hidden], chunks=2)


def test_a_stage_runner_cuts_its_input_so_its_backward_is_its_own():
    from parallel_lib.pipeline_parallel import StageRunner
    first = StageRunner(nn.Linear(2, 2), torch.device("cpu"), first=True)
    last = StageRunner(nn.Sequential(nn.ReLU(inplace=True), nn.Linear(2, 1)), torch.device("cpu"), first=False)
    saved0, y = first.forward(torch.randn(3, 2))
    assert not y.requires_grad  # handed over detached
    saved1, loss = last.forward(y, loss=lambda out: out.sum())
    grad = last.backward(saved1, None)
    assert first.module.weight.grad is None  # stage 1's backward stopped at its own input
    assert grad.shape == (3, 2)
    assert first.backward(saved0, grad) is None and first.module.weight.grad is not None


def test_the_receiving_stage_moves_its_input_to_its_own_device_once():
    """The documented GPU design: the hand-over is one ``Tensor.to`` onto the stage's device (ordered on
    both devices' current streams by PyTorch), and the cut adds no second copy."""
    from parallel_lib.pipeline_parallel.stage import cut
    x, mask = torch.randn(2, 3), torch.ones(2, dtype=torch.long)
    leaves, (inputs, mask_in) = cut((x, mask), torch.device("meta"))  # "meta": a device other than x's
    assert all(t.device.type == "meta" for t in (*leaves, inputs, mask_in))
    leaves, inputs = cut(x, torch.device("cpu"))
    assert leaves[0].requires_grad and not inputs.is_leaf and inputs.data_ptr() == x.data_ptr()
    assert not cut(mask, torch.device("cpu"))[0][0].requires_grad  # integer tensors carry no gradient


class _Scale(nn.Module):
    """An element-wise layer: cheap enough for 64 MB activations on a CPU."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x):
        return torch.tanh(x) * self.weight


def test_64_mb_activations_cross_stages_and_train_exactly():
    """Each micro-batch hands 64 MB to the next stage and 64 MB of gradient back, as a GPU stage would."""
    width = 2**20
    model = nn.Sequential(_Scale(width), _Scale(width))
    x = torch.randn(32, width)  # two micro-batches of 16 x 2**20 float32 values: 64 MB each
    y = torch.zeros(32, width)
    expected = reference_grads(model, x, y)
    with Pipe(model, [0, 1], chunks=2, schedule="1f1b") as pipe:
        pipe.train_step(x, y, mse)
    assert_grads(model, expected)


def test_moving_a_pipe_to_a_gpu_index_is_the_refusal_on_any_machine():
    pipe = Pipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), ["cpu", "cpu"])
    for args, kwargs in [((0,), {}), (("cuda:0",), {}), ((), {"device": 1}), ((torch.device("cpu"),), {})]:
        with pytest.raises(TypeError, match="a Pipe places its stages itself"):
            pipe.to(*args, **kwargs)
    assert pipe.to(torch.float64) is pipe and pipe.partitions[0][0].weight.dtype == torch.float64
    pipe.close()


def test_too_few_layers_for_two_stages_per_device_says_so():
    layers = nn.Sequential(*[nn.Linear(2, 2) for _ in range(3)])
    with pytest.raises(ValueError, match=r"schedule='interleaved' cuts the layers into 2 stages per device, so 2 "
                                         r"devices need at least 4 layers, and the module has 3; use at most 1 "):
        Pipe(layers, ["cpu", "cpu"], schedule="interleaved")


@pytest.mark.parametrize("schedule", ["dualpipev", "interleaved"])
def test_a_batch_with_fewer_rows_than_chunks_names_rows_not_m(schedule):
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)])
    with Pipe(model, ["cpu", "cpu"], chunks=4, schedule=schedule) as pipe:
        message = (rf"schedule='{schedule}' on 2 devices cannot run 3 micro-batches \(the next number it runs is 4\): "
                   r"the batch's 3 rows split into only 3 micro-batches of one row, not chunks=4; give a batch of "
                   r"at least 4 rows$")
        with pytest.raises(ValueError, match=message):
            pipe.train_step(torch.randn(3, 2), torch.randn(3, 2), mse)
        with pytest.raises(ValueError, match=message):
            pipe(torch.randn(3, 2))


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "zb-h2", "interleaved", "zbv", "dualpipev"])
def test_every_schedule_refuses_a_float_size_alike(name):
    with pytest.raises(ValueError, match=r"p must be an int >= 1, got p=2.0 \(float\)"):
        make_schedule(name, 2.0, 4)
    with pytest.raises(ValueError, match=r"m must be an int >= 1, got m=4.0 \(float\)"):
        make_schedule(name, 2, 4.0)


def test_simulate_names_a_cost_that_is_not_a_number_and_all_zero_costs():
    schedule = make_schedule("1f1b", 2, 4)
    with pytest.raises(TypeError, match=r"stage_costs must hold numbers \(times\), got '1' \(str\) in "
                                        r"stage_costs=\('1', 1\); e.g. stage_costs=\(1.0, 2.0\)"):
        simulate(schedule, ("1", 1))
    with pytest.raises(TypeError, match=r"stage_costs must hold numbers \(times\), got 'a' \(str\)"):
        simulate(schedule, [(1.0, 1.0), ("a", 1.0)])
    for costs in ("1", 5):
        with pytest.raises(TypeError, match=r"stage_costs must be one \(forward, backward\[, weight\]\) tuple of "
                                            r"numbers or a list of 2 of them .*e.g. stage_costs=\(1.0, 2.0\)"):
            simulate(schedule, costs)
    for costs in ((0, 0), (0.0, 0.0, 0.0), [(0, 0), (0, 0)]):
        with pytest.raises(ValueError, match=r"stage_costs are all zero .* give positive costs, e.g. "):
            simulate(schedule, costs)


def test_a_stage_whose_forward_runs_a_layer_twice_splits_its_backward_exactly():
    # W was once cut between an nn.Sequential's layers, and a layer run twice was refused; it is now
    # cut at each parameterised operation, so each of the two calls keeps its own input and output
    # gradient, and W sums the shared weight's two parts
    from parallel_lib.pipeline_parallel.stage import StageRunner

    class Twice(nn.Sequential):
        def forward(self, x):
            return self[1](torch.tanh(self[0](torch.tanh(self[0](x)))))

    torch.manual_seed(0)
    model, x = Twice(nn.Linear(2, 2), nn.Linear(2, 2)), torch.randn(3, 2)
    runner = StageRunner(model, torch.device("cpu"), first=True)
    saved, _ = runner.forward(x, lambda y: y.square().sum())
    runner.backward(saved, None)
    whole = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    saved, _ = runner.forward(x, lambda y: y.square().sum(), split=True)
    _, todo = runner.backward_input(saved, None)
    assert all(p.grad is None for p in model.parameters())  # B writes no weight gradient
    runner.backward_weight(todo)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), whole))
