"""Tests for parallel_lib.common.training: the weighted loss, the step order, the record, evaluation."""

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from _timing import assert_clock_reads_follow_syncs, record_clock_reads

from parallel_lib.common import TrainRecord, build_gpt2, evaluate, forward_loss, train, weighted_cross_entropy
from parallel_lib.data import collate_batch, get_tokenizer, load_corpus, partition_dataset

VOCAB = 512  # the same as test_text's, so the in-memory cache trains it once per session


@pytest.fixture(scope="module")
def collate():
    tokenizer = get_tokenizer(load_corpus("train"), vocab_size=VOCAB)
    return functools.partial(collate_batch, src_key="de", tgt_key="en", tokenizer=tokenizer, model_max_length=128)


@pytest.fixture
def model(collate):
    return build_gpt2("tiny", vocab_size=len(collate.keywords["tokenizer"]), seed=0)


def test_weighted_cross_entropy_averages_over_weighted_tokens_only():
    logits, labels = torch.randn(2, 3, 5, requires_grad=True), torch.randint(0, 5, (2, 3))
    weights = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]])
    ce = F.cross_entropy(logits.reshape(6, 5), labels.reshape(6), reduction="none").reshape(2, 3)
    loss = weighted_cross_entropy(logits, labels, weights)
    torch.testing.assert_close(loss, (ce * weights).sum() / 3)
    loss.backward()
    assert logits.grad[weights == 0].abs().sum() == 0  # source and padding positions get no gradient
    torch.testing.assert_close(weighted_cross_entropy(logits, labels, weights, denominator=10.0),
                               (ce * weights).sum() / 10)
    assert weighted_cross_entropy(logits, labels, torch.zeros(2, 3)).item() == 0.0  # not NaN


def test_global_denominator_makes_summed_shard_losses_equal_the_whole_batch():
    # the data-parallel identity: each rank divides by the global batch's weight, the all-reduce sums
    logits, labels = torch.randn(4, 6, 7), torch.randint(0, 7, (4, 6))
    weights = (torch.rand(4, 6) > 0.3).float()
    whole = weighted_cross_entropy(logits, labels, weights)
    shards = sum(weighted_cross_entropy(logits[i:i + 2], labels[i:i + 2], weights[i:i + 2],
                                        denominator=weights.sum()) for i in (0, 2))
    torch.testing.assert_close(shards, whole)


def test_weighted_cross_entropy_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"logits must be \(B, T, V\).*labels \(2, 4\)"):
        weighted_cross_entropy(torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4))


def test_forward_loss_takes_logits_without_shifting_again(model, collate):
    batch = collate(load_corpus("test", 4))
    logits = model(batch["input_ids"]).logits
    expected = weighted_cross_entropy(logits, batch["labels"], batch["label_token_weights"])
    torch.testing.assert_close(forward_loss(model, batch), expected)

    class LogitsOnly(torch.nn.Module):  # a pipeline or a plain module returns the tensor itself
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, input_ids):
            return self.inner(input_ids).logits

    torch.testing.assert_close(forward_loss(LogitsOnly(), batch), expected)


def test_train_reduces_the_loss_and_records_every_step(model, collate):
    loader = partition_dataset(0, 1, load_corpus("train"), batch_size=16, collate_fn=collate)
    validation = [collate(load_corpus("validation", 64))]
    before = evaluate(model, validation)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    record = train(model, optimizer, loader, desc="test", progress=False, max_steps=30)
    after = evaluate(model, validation)
    assert before > 5.5 and after < before - 0.8, (before, after)  # ln(512) = 6.2 at the start

    assert record.steps == len(record.tokens) == len(record.step_times) == len(record.tokens_per_sec) == 30
    expected_tokens = [int(batch["label_token_weights"].sum()) for _, batch in zip(range(30), loader)]
    assert record.tokens == expected_tokens  # target tokens, the same batches again (epoch 0)
    assert all(t > 0 for t in record.step_times) and all(math.isfinite(x) for x in record.losses)
    for tokens, seconds, rate in zip(record.tokens, record.step_times, record.tokens_per_sec):
        assert rate == pytest.approx(tokens / seconds)
    assert record.throughput() == pytest.approx(record.total_tokens / record.total_time)
    assert record.summary()["steps"] == 30 and record.final_loss == record.losses[-1]


def test_average_gradients_fn_runs_once_per_step_between_backward_and_step(model, collate):
    events = []

    class SpySGD(torch.optim.SGD):
        def zero_grad(self, set_to_none=True):
            events.append("zero_grad")
            super().zero_grad(set_to_none)

        def step(self, closure=None):
            events.append("step")
            return super().step(closure)

    def average(m):
        assert all(p.grad is not None for p in m.parameters()), "called before backward finished"
        events.append("average")

    model.register_forward_pre_hook(lambda module, args: events.append("forward"))
    model.transformer.h[0].mlp.c_fc.weight.register_hook(lambda grad: events.append("backward"))
    batches = [collate(load_corpus("train", 8))] * 3
    train(model, SpySGD(model.parameters(), lr=0.1), batches, average_gradients_fn=average, progress=False)
    assert events == ["zero_grad", "forward", "backward", "average", "step"] * 3


def test_average_gradients_fn_decides_the_update(model, collate):
    before = {name: p.detach().clone() for name, p in model.named_parameters()}

    def drop_gradients(m):  # what the optimizer sees is what this function left
        for p in m.parameters():
            p.grad.zero_()

    train(model, torch.optim.SGD(model.parameters(), lr=0.1), [collate(load_corpus("train", 8))] * 2,
          average_gradients_fn=drop_gradients, progress=False)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, before[name], msg=f"{name} moved")


def test_evaluate_weights_batches_by_tokens_and_restores_the_mode(model, collate):
    batches = [collate(load_corpus("test", 2)), collate(load_corpus("validation", 9))]
    with torch.no_grad():
        losses = [forward_loss(model.eval(), b).item() for b in batches]
    weights = [b["label_token_weights"].sum().item() for b in batches]
    expected = sum(l * w for l, w in zip(losses, weights)) / sum(weights)
    for mode in (True, False):
        model.train(mode)
        assert evaluate(model, batches) == pytest.approx(expected)
        assert model.training is mode
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="at least one target token"):
        evaluate(model, [])


def test_train_progress_bar_and_bad_max_steps(model, collate, capsys):
    batches = [collate(load_corpus("train", 4))] * 2
    record = train(model, torch.optim.SGD(model.parameters(), lr=0.1), batches, desc="tiny run", progress=True,
                   max_steps=5)
    assert record.steps == 2 and "tiny run" in capsys.readouterr().err
    with pytest.raises(ValueError, match="max_steps must be a non-negative int"):
        train(model, torch.optim.SGD(model.parameters(), lr=0.1), batches, max_steps=-1)
    assert isinstance(TrainRecord(), TrainRecord) and math.isnan(TrainRecord().final_loss)


# --- one timed-step record ---------------------------------------------------------------------------

def test_every_clock_read_of_train_waits_for_the_models_devices(model, collate, monkeypatch):
    log = record_clock_reads(monkeypatch)
    batches = [collate(load_corpus("train", 4))] * 3
    record = train(model, torch.optim.SGD(model.parameters(), lr=0.1), batches, progress=False,
                   average_gradients_fn=lambda m: None)
    # start, after backward, after the gradient sync, after the optimizer: four synchronised reads per step
    assert assert_clock_reads_follow_syncs(log, ("cpu",)) == 4 * 3
    assert set(record.phases) == {"compute", "sync", "optimizer"}
    for k in range(3):
        assert sum(record.phases[p][k] for p in record.phases) == pytest.approx(record.step_times[k])


def test_train_record_phases_must_be_the_same_every_step():
    record = TrainRecord()
    record.append(2.0, 10, 0.5, {"compute": 0.4, "sync": 0.1})
    record.append(1.0, 30, 0.5, {"sync": 0.2, "compute": 0.3})
    assert record.phases == {"compute": [0.4, 0.3], "sync": [0.1, 0.2]}
    with pytest.raises(ValueError, match=r"phases must name the same phases at every step: \['compute', 'sync'\] "
                                         r"so far, got \['compute'\] at step 2"):
        record.append(1.0, 30, 0.5, {"compute": 0.5})
    plain = TrainRecord()
    plain.append(2.0, 10, 0.5)  # a loop that does not split its steps
    assert plain.phases == {} and plain.tokens_per_sec == [20.0]


def test_train_record_from_steps_extend_and_the_throughput_after_warmup():
    record = TrainRecord.from_steps([3.0, 2.0, 1.0], [10, 20, 30], [1.0, 0.5, 0.5], {"sync": [0.1, 0.2, 0.3]})
    assert record.tokens_per_sec == [10.0, 40.0, 60.0] and record.phases == {"sync": [0.1, 0.2, 0.3]}
    assert record.throughput() == 60 / 2.0 and record.throughput(skip=1) == 50 / 1.0
    assert record.summary(warmup=1) == {"steps": 3, "tokens": 60, "seconds": 2.0, "tokens_per_sec": 50.0,
                                        "final_loss": 1.0}
    assert record.describe_throughput(1) == "50.0 target tokens/s (steps 1..2)"
    assert math.isnan(record.throughput(skip=3))
    assert record.describe_throughput(3) == ("not measured: the run has 3 steps and the first 3 are warm-up; "
                                             "run more than 3 steps")
    both = TrainRecord()
    both.extend(record)
    both.extend(record)
    assert both.steps == 6 and both.losses == [3.0, 2.0, 1.0] * 2 and both.phases["sync"] == [0.1, 0.2, 0.3] * 2
    with pytest.raises(ValueError, match=r"one entry per step, got lengths \{'losses': 2, 'tokens': 1"):
        TrainRecord.from_steps([1.0, 2.0], [3], [1.0, 1.0])
