"""Naive model parallelism: a split GPT-2 computes exactly what the whole one computes."""

import copy
import time

import pytest
import torch
from torch import nn

from parallel_lib.common import build_gpt2, count_parameters, max_concurrency
from parallel_lib.model_parallel import (
    balance_by_params,
    balance_by_time,
    deparallelize,
    get_device_map,
    parallelize,
    parallelize_sequential,
    placement,
    record_timeline,
)

VOCAB = 256  # small head: the tests time the blocks, not a 50k-wide matmul

MAPS = {
    2: {0: [0, 1], 1: [2, 3]},
    3: {0: [0, 1], 1: [2], 2: [3]},
    4: {0: [0], 1: [1], 2: [2], 3: [3]},
}


def _batch(batch_size=3, seq_len=12):
    input_ids = torch.randint(0, VOCAB, (batch_size, seq_len))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 8:] = 0  # right padding, as collate_batch makes it
    attention_mask[2, 5:] = 0
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)


def _run(model, batch):
    out = model(**batch)
    out.loss.backward()
    return out, {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("entries", sorted(MAPS))
def test_parallelized_gpt2_matches_unsplit(entries):
    reference = build_gpt2("tiny", vocab_size=VOCAB)
    model = parallelize(copy.deepcopy(reference), MAPS[entries])
    batch = _batch()
    expected, expected_grads = _run(reference, batch)
    actual, actual_grads = _run(model, batch)
    torch.testing.assert_close(actual.logits, expected.logits)
    torch.testing.assert_close(actual.loss, expected.loss)
    assert expected_grads.keys() == actual_grads.keys()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(actual_grads[name], grad, msg=f"grad of {name}")


def test_parallelize_keeps_the_tied_head_and_records_the_map():
    model = build_gpt2("tiny", vocab_size=VOCAB)
    before = count_parameters(model)
    parallelize(model, MAPS[3])
    assert count_parameters(model) == before
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.device_map == MAPS[3]
    assert [(key, name) for key, name, _ in placement(model)] == [
        (0, "wte"), (0, "wpe"), (0, "h0"), (0, "h1"), (1, "h2"), (2, "h3"), (2, "ln_f"), (0, "lm_head")]


def test_deparallelize_restores_a_plain_model():
    reference = build_gpt2("tiny", vocab_size=VOCAB)
    model = deparallelize(parallelize(copy.deepcopy(reference), MAPS[4]))
    assert not hasattr(model, "device_map")
    hooks = [m._forward_pre_hooks for m in model.modules()]
    assert all(len(h) == 0 for h in hooks), "hooks left behind"
    batch = _batch()
    torch.testing.assert_close(model(**batch).logits, reference(**batch).logits)


def test_parallelize_gpt2model_without_head():
    reference = build_gpt2("tiny", vocab_size=VOCAB).transformer
    model = parallelize(copy.deepcopy(reference), MAPS[2])
    assert [name for _, name, _ in placement(model)][-1] == "ln_f"
    batch = _batch()
    del batch["labels"]
    torch.testing.assert_close(model(**batch).last_hidden_state, reference(**batch).last_hidden_state)


def test_adamw_training_through_the_split_model_matches_unsplit():
    reference = build_gpt2("tiny", vocab_size=VOCAB)
    model = parallelize(copy.deepcopy(reference), MAPS[3])
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, model)]
    losses = {"reference": [], "parallel": []}
    batch = _batch()
    for _ in range(3):
        for m, opt, key in zip((reference, model), optimizers, losses):
            opt.zero_grad()
            loss = m(**batch).loss
            loss.backward()
            opt.step()
            losses[key].append(loss.item())
    assert losses["parallel"] == pytest.approx(losses["reference"], rel=1e-5)
    assert losses["parallel"][-1] < losses["parallel"][0], "AdamW steps on one batch lower its loss"
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(q, p, msg=f"parameter {name} after 3 steps")


def test_timeline_shows_one_device_at_a_time_in_execution_order():
    model = parallelize(build_gpt2("tiny", vocab_size=VOCAB), MAPS[2])
    with record_timeline(model) as events:
        model(**_batch()).loss.backward()
    assert max_concurrency(events, tolerance=0.0) == 1
    assert [(e.lane, e.kind, e.label) for e in events] == [
        ("device 0", "forward", "wte"), ("device 0", "forward", "wpe"), ("device 0", "forward", "h0"),
        ("device 0", "forward", "h1"), ("device 1", "forward", "h2"), ("device 1", "forward", "h3"),
        ("device 1", "forward", "ln_f"), ("device 0", "forward", "lm_head"), ("device 0", "forward", "loss"),
        ("device 0", "backward", "loss"), ("device 0", "backward", "lm_head"), ("device 1", "backward", "ln_f"),
        ("device 1", "backward", "h3"), ("device 1", "backward", "h2"), ("device 0", "backward", "h1"),
        ("device 0", "backward", "h0")]
    assert {e.micro_batch for e in events} == {0}
    # the hooks are gone afterwards
    assert all(len(m._forward_hooks) == 0 for m in model.modules())


def test_timeline_on_gpus_times_each_part_with_events_on_its_own_device(monkeypatch):
    # map keys resolve to two (fake) GPUs; the parts stay on the CPU and compute for real
    from _fake_cuda import install

    from parallel_lib.model_parallel import timeline

    model = parallelize(build_gpt2("tiny", vocab_size=VOCAB), MAPS[2])
    cuda = install(monkeypatch)
    monkeypatch.setattr(timeline, "resolve_device", lambda key: torch.device("cuda", key))
    with record_timeline(model) as events:
        model(**_batch()).loss.backward()
        assert events == [] and cuda.synchronized == ["cuda:0", "cuda:1"]  # no wait while it runs
    assert cuda.synchronized[2:] == ["cuda:0", "cuda:1"]  # one wait per GPU, at the end
    for k in (0, 1):
        on_lane = [e for e in events if e.lane == f"device {k}"]
        # a start and an end event per bar, on the part's own device, plus that device's zero event;
        # the "loss" bar on device 0 starts at the LM head's end event rather than a new one
        assert len(cuda.recorded_on(f"cuda:{k}")) == 2 * len(on_lane) + 1 - (k == 0)
    assert {e.label for e in events if e.lane == "device 1"} == {"h2", "h3", "ln_f"}
    assert max_concurrency(events, tolerance=0.0) == 1 and len(events) == 16


def test_timeline_counts_forward_calls_and_skips_backward_under_no_grad():
    model = parallelize_sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), {0: [0, 1], 1: [2]})
    with record_timeline(model) as events, torch.no_grad():
        model(torch.randn(2, 4))
        model(torch.randn(2, 4))
    assert [(e.lane, e.micro_batch) for e in events] == [("device 0", 0), ("device 0", 0), ("device 1", 0),
                                                        ("device 0", 1), ("device 0", 1), ("device 1", 1)]
    assert {e.kind for e in events} == {"forward"}


class _SeesDevice(nn.Module):
    """Records the device of the input it receives."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        self.seen.append(x.device.type)
        return x * 2


def test_the_map_is_honoured_inputs_move_to_each_parts_device():
    # "meta" stands in for a second accelerator: a tensor that reaches layer 1 unmoved would be on cpu
    model = parallelize_sequential(nn.Sequential(_SeesDevice(), _SeesDevice()), {"cpu": [0], "meta": [1]})
    out = model(torch.ones(2))
    assert [m.seen for m in model] == [["cpu"], ["meta"]]
    assert out.device.type == "meta"


def test_parallelize_sequential_matches_unsplit():
    reference = nn.Sequential(*[nn.Linear(8, 8) for _ in range(5)])
    model = parallelize_sequential(copy.deepcopy(reference), get_device_map(5, [0, 1, 2]))
    x = torch.randn(4, 8)
    torch.testing.assert_close(model(x), reference(x))


def test_bad_models_and_maps():
    with pytest.raises(TypeError, match="GPT2LMHeadModel, GPT2Model or nn.Sequential"):
        parallelize(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="use parallelize_sequential"):
        parallelize(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(TypeError, match="must be an nn.Sequential"):
        parallelize_sequential(build_gpt2("tiny", vocab_size=VOCAB), {0: [0, 1, 2, 3]})
    with pytest.raises(ValueError, match="once each, contiguous"):
        parallelize(build_gpt2("tiny", vocab_size=VOCAB), {0: [0, 1], 1: [2]})


# --- placement moves each part straight to its own device ----------------------------------------

def _record_moves(monkeypatch):
    """``id(tensor) -> [devices it was sent to]`` for every ``Tensor.to`` from now on.

    Int keys resolve to distinct fake devices ``cpu:k`` (tensors stay on the CPU, but the
    device each ``.to`` asked for is recorded), so a parameter sent to device 0 on its way
    to device 2 shows up as ``[cpu:0, cpu:2]``.
    """
    import parallel_lib.model_parallel.placing as placing

    sent = {}
    real_to = torch.Tensor.to

    def recording_to(self, *args, **kwargs):
        target = kwargs.get("device", args[0] if args else None)
        if isinstance(target, (str, torch.device)):
            sent.setdefault(id(self), []).append(torch.device(target))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(placing, "resolve_device",
                        lambda key: torch.device("cpu", key) if isinstance(key, int) else torch.device(key))
    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    return sent


def _tensors_by_device(model, device_map):
    """``(fake device, name, id)`` of every parameter and buffer of every placed part, taken before the move
    (a buffer moved by ``.to`` is a new tensor; a parameter keeps its object)."""
    return [(torch.device("cpu", key), f"{name}.{tensor_name}", id(tensor))
            for key, name, part in placement(model, device_map)
            for tensor_name, tensor in [*part.named_parameters(), *part.named_buffers()]]


def _assert_moved_only_to_their_own_device(tensors, sent):
    for own, name, tensor_id in tensors:
        assert sent.get(tensor_id), f"{name} was never moved to {own}"
        assert set(sent[tensor_id]) == {own}, f"{name} went to {sent[tensor_id]}, not only to {own}"


@pytest.mark.parametrize("entries", sorted(MAPS))
def test_parallelize_moves_every_parameter_straight_to_its_device(monkeypatch, entries):
    model = build_gpt2("tiny", vocab_size=VOCAB)
    tensors = _tensors_by_device(model, MAPS[entries])
    sent = _record_moves(monkeypatch)
    parallelize(model, MAPS[entries])
    assert len(tensors) >= len(list(model.parameters()))
    _assert_moved_only_to_their_own_device(tensors, sent)
    # no block ever passed through the first device: that is what sinks GPU 0 for a model that needs MP
    block_on_last = model.transformer.h[3].mlp.c_fc.weight
    assert sent[id(block_on_last)] == [torch.device("cpu", entries - 1)]


def test_buffers_move_with_their_module_and_loose_tensors_go_with_the_inputs(monkeypatch):
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), nn.BatchNorm1d(4))
    model.register_buffer("scale", torch.ones(1))  # belongs to no part: it goes where the inputs go, device 0
    device_map = {0: [0, 1], 1: [2, 3]}
    tensors, loose = _tensors_by_device(model, device_map), id(model.scale)
    sent = _record_moves(monkeypatch)
    parallelize_sequential(model, device_map)
    assert len(tensors) == 8 + 6  # weights and biases of 4 layers; 3 buffers of each batch norm
    _assert_moved_only_to_their_own_device(tensors, sent)
    assert sent[loose] == [torch.device("cpu", 0)]


def test_parallelize_default_map_uses_all_visible_devices():
    model = parallelize(build_gpt2("tiny", vocab_size=VOCAB))
    assert model.device_map == get_device_map(4, list(range(max(torch.cuda.device_count(), 1))))


def test_balance_by_params_gives_the_embedding_device_fewer_blocks():
    model = build_gpt2("tiny", vocab_size=4096)  # embedding 4096 x 64 = 5 blocks' worth of parameters
    assert balance_by_params(model, [0, 1]) == {0: [0], 1: [1, 2, 3]}
    layers = nn.Sequential(nn.Linear(64, 64), nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    assert balance_by_params(layers, ["a", "b"]) == {"a": [0], "b": [1, 2, 3]}


class _Slow(nn.Module):
    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        time.sleep(self.seconds)
        return self.linear(x)


def test_balance_by_time_puts_a_slow_layer_alone():
    model = nn.Sequential(_Slow(0.04), _Slow(0.0), _Slow(0.0), _Slow(0.0))
    assert balance_by_time(model, torch.randn(2, 4), [0, 1], repeat=1) == {0: [0], 1: [1, 2, 3]}
    model = nn.Sequential(_Slow(0.0), _Slow(0.0), _Slow(0.0), _Slow(0.04))
    assert balance_by_time(model, torch.randn(2, 4), [0, 1], repeat=1) == {0: [0, 1, 2], 1: [3]}
    assert all(p.grad is None for p in model.parameters()), "profiling must not leave gradients"


def test_balance_by_time_on_gpt2_returns_a_valid_map():
    model = build_gpt2("tiny", vocab_size=VOCAB)
    device_map = balance_by_time(model, _batch(), [0, 1], repeat=1)
    assert sorted(l for layers in device_map.values() for l in layers) == [0, 1, 2, 3]
    assert all(device_map.values())
    with pytest.raises(ValueError, match="repeat must be >= 1"):
        balance_by_time(model, _batch(), [0, 1], repeat=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_parallelized_gpt2_across_real_devices_matches_cpu():
    # two GPUs when there are, else one GPU and the CPU: hidden states and gradients really cross devices
    first, second = ("cuda:0", "cuda:1") if torch.cuda.device_count() >= 2 else ("cuda:0", "cpu")
    reference = build_gpt2("tiny", vocab_size=VOCAB)
    model = parallelize(copy.deepcopy(reference), {first: [0, 1], second: [2, 3]})
    assert model.transformer.h[3].attn.c_attn.weight.device == torch.device(second)
    assert model.lm_head.weight.device == torch.device(first)
    batch = _batch()
    expected, expected_grads = _run(reference, batch)
    actual, actual_grads = _run(model, batch)  # inputs on the CPU: the hooks move them
    torch.testing.assert_close(actual.logits.cpu(), expected.logits, rtol=1e-4, atol=1e-4)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(actual_grads[name].cpu(), grad, rtol=1e-4, atol=1e-4, msg=name)
    with record_timeline(model) as events:
        model(**batch).loss.backward()
    assert max_concurrency(events, tolerance=0.0) == 1
