"""The threaded Pipe runs every chapter 08 schedule: same loss and gradients as the unsplit model
(to float tolerance: micro-batches add their gradients in each schedule's own order), the schedule's
order followed; recomputation gives bitwise the gradients of the run without it, and its memory is measured."""

import copy
import functools

import pytest
import torch
from torch import nn

from parallel_lib.common import build_gpt2
from parallel_lib.pipeline_parallel import Pipe, gpt2_stages, lm_loss, make_schedule, stages_per_rank

mse = nn.functional.mse_loss
ALL = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zbv", "dualpipev"]


def mlp(layers=8, width=6):
    torch.manual_seed(1)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)])


def check(model, reference, loss, expected_loss, bitwise):
    same = functools.partial(torch.testing.assert_close, rtol=0, atol=0) if bitwise else torch.testing.assert_close
    same(loss, expected_loss)
    expected = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        same(p.grad, expected[name].grad, msg=lambda text, name=name: f"gradient of {name}: {text}")


@pytest.mark.parametrize("schedule, p, m", [(name, p, m) for p, m in [(2, 4), (2, 8), (4, 4), (4, 8)] for name in ALL
                                            if name != "dualpipev" or m >= 2 * p])  # DualPipeV: m >= 2p
def test_every_schedule_matches_the_unsplit_model(schedule, p, m):
    model, x, y = mlp(), torch.randn(16, 6), torch.randn(16, 6)
    reference = copy.deepcopy(model)
    expected = mse(reference(x), y)
    expected.backward()
    with Pipe(model, ["cpu"] * p, chunks=m, schedule=schedule) as pipe:
        assert len(pipe.partitions) == p * stages_per_rank(schedule)
        loss = pipe.train_step(x, y, mse)
        events = pipe.timeline.events
    check(model, reference, loss, expected.detach(), bitwise=False)
    order = make_schedule(schedule, p, m)  # each rank ran its list in order
    for j, actions in enumerate(order.stages):
        lane = sorted((e for e in events if e.lane == f"stage {j}"), key=lambda e: e.start)
        assert len(lane) == len(actions)
        assert [(e.micro_batch, e.label.startswith("W")) for e in lane] == [(a.micro_batch, a.kind == "W")
                                                                           for a in actions]


@pytest.mark.parametrize("schedule", ALL)
def test_gpt2_stages_run_every_schedule(schedule):
    model = build_gpt2("tiny", vocab_size=61, n_layer=4)
    reference = copy.deepcopy(model)
    ids, labels = torch.randint(0, 61, (4, 8)), torch.randint(0, 61, (4, 8))
    lm_loss(reference(ids).logits, labels).backward()
    v = stages_per_rank(schedule)
    stages = gpt2_stages(model, ["cpu"] * (2 * v))  # one Pipe layer per model stage
    with Pipe(stages, ["cpu", "cpu"], chunks=4, schedule=schedule) as pipe:
        loss = pipe.train_step(ids, labels, lm_loss, reduction="mean")
    torch.testing.assert_close(loss, lm_loss(reference(ids).logits, labels).detach())
    expected = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name].grad, msg=lambda text, name=name: f"{name}: {text}")


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_recomputation_keeps_gradients_and_cuts_saved_activation_bytes(checkpoint):
    model, x, y = mlp(width=64), torch.randn(32, 64), torch.randn(32, 64)
    reference = copy.deepcopy(model)
    with Pipe(reference, ["cpu"] * 2, chunks=4, schedule="1f1b") as pipe:
        expected = pipe.train_step(x, y, mse)
    with Pipe(model, ["cpu"] * 2, chunks=4, schedule="1f1b", checkpoint=checkpoint) as pipe:
        loss = pipe.train_step(x, y, mse)
        peak = pipe.peak_activation_bytes
    check(model, reference, loss, expected, bitwise=True)  # the same forward, run again
    rows, width, layers = 8, 64, 4  # per micro-batch and stage: each Linear saves its input, each Tanh
    full = (layers + 1) * rows * width * 4  # its output, which is the next Linear's input: 5 tensors
    just_input = rows * width * 4
    if checkpoint == "never":
        # 1F1B: rank 0 holds 2 micro-batches, rank 1 one, plus what the MSE loss saves (one more tensor)
        assert peak == [2 * full, full + just_input]
    elif checkpoint == "always":
        assert peak == [2 * just_input, just_input]
    else:
        assert just_input * 2 <= peak[0] < 2 * full


def test_unknown_schedule_and_checkpoint_are_refused():
    with pytest.raises(ValueError, match="schedule must be one of"):
        Pipe(mlp(), ["cpu"] * 2, schedule="zero-bubble")
    with pytest.raises(ValueError, match="checkpoint must be one of"):
        Pipe(mlp(), ["cpu"] * 2, checkpoint="sometimes")
    with pytest.raises(ValueError, match="give a list of devices"):
        Pipe(mlp(), {"cpu": [0, 1, 2, 3], 1: [4, 5, 6, 7]}, schedule="interleaved")


def test_a_hand_written_schedule_runs_on_the_pipe_with_its_own_placement():
    from parallel_lib.pipeline_parallel import Action, Schedule
    v_shape = make_schedule("zbv", 2, 4)
    hand = Schedule("mine", 2, 4, v_shape.stages, v_shape.placement)  # a Schedule object, not a name
    model, x, y = mlp(), torch.randn(16, 6), torch.randn(16, 6)
    reference = copy.deepcopy(model)
    expected = mse(reference(x), y)
    expected.backward()
    with Pipe(model, ["cpu", "cpu"], chunks=4, schedule=hand) as pipe:
        assert pipe.placement == (0, 1, 1, 0) and pipe.make_schedule(4) is hand
        loss = pipe.train_step(x, y, mse)
        with pytest.raises(ValueError, match="schedule 'mine' is written for 4 micro-batches, got 8: give chunks=4"):
            pipe.chunks = 8
            pipe.train_step(x, y, mse)
    check(model, reference, loss, expected.detach(), bitwise=False)
    broken = Schedule("broken", 2, 1, ((Action("B", 0), Action("F", 0)), (Action("F", 0), Action("B", 0))))
    with pytest.raises(ValueError, match="stage 0 runs B0 before F0"):
        Pipe(mlp(), ["cpu", "cpu"], chunks=1, schedule=broken)
    with pytest.raises(ValueError, match="schedule 'mine' is written for 2 ranks, got 3 devices"):
        Pipe(mlp(), ["cpu"] * 3, chunks=4, schedule=hand)
