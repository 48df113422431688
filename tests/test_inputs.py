"""Bad input that used to be accepted or misreported: each is now a ValueError/TypeError naming the argument.

One test per mistake a student makes in class; each failed before its fix (the message
it now checks for did not exist, or the call silently succeeded).
"""

from __future__ import annotations

import functools
import sys
import types

import pytest
import torch
from torch.utils.data import DataLoader

from parallel_lib.common.models import build_gpt2, gpt2_config
from parallel_lib.data import collate_batch, get_tokenizer, load_corpus, load_hf_translation
from parallel_lib.data.partition import DataPartitioner, PartitionSampler, partition_dataset
from parallel_lib.data_parallel.cli import main as dp_main
from parallel_lib.model_parallel.device_map import get_device_map, naive_device_map
from parallel_lib.model_parallel.memory import GiB, memory_verdict, training_memory
from parallel_lib.planner.strategy import plan


@pytest.fixture(scope="module")
def tokenizer():
    return get_tokenizer(load_corpus("train", 64), vocab_size=300)


# --- models -----------------------------------------------------------------------------------------

def test_unknown_model_override_is_refused_with_the_likely_name():
    with pytest.raises(ValueError, match=r"\['n_layers'\].*did you mean n_layer\?"):
        build_gpt2("tiny", n_layers=8)
    with pytest.raises(ValueError, match="n_embed"):
        gpt2_config("tiny", n_embed=32)
    assert build_gpt2("tiny", vocab_size=64, n_layer=2).config.n_layer == 2  # real fields still work
    assert gpt2_config("tiny", hidden_size=32).n_embd == 32  # and their aliases


def test_sequence_longer_than_the_model_names_n_positions():
    model = build_gpt2("tiny", vocab_size=64)  # n_positions=128
    model(torch.zeros(1, 128, dtype=torch.long))  # the longest allowed
    with pytest.raises(ValueError, match=r"129 tokens is longer than the model's n_positions=128"):
        model(torch.zeros(1, 129, dtype=torch.long))


# --- device lists -----------------------------------------------------------------------------------

@pytest.mark.parametrize("devices, fragment", [("cpu", r"devices='cpu' \(str\)"), (2, r"list\(range\(2\)\)"),
                                               (torch.device("cpu"), "devices=device")])
def test_one_device_key_where_a_list_is_expected(devices, fragment):
    for make in (get_device_map, naive_device_map):
        with pytest.raises(TypeError, match=fragment):
            make(4, devices)


# --- memory estimates -------------------------------------------------------------------------------

@pytest.mark.parametrize("device_bytes, fragment", [(0, "must be > 0"), (-16 * GiB, "must be > 0"),
                                                    (float("nan"), "finite"),
                                                    (80, r"in bytes.*pass 80 \* GiB")])
def test_device_memory_that_is_not_plausible_bytes(device_bytes, fragment):
    estimate = training_memory(124_000_000, "fp16")
    with pytest.raises(ValueError, match=fragment):
        estimate.min_devices(device_bytes)
    with pytest.raises(ValueError, match=fragment):
        memory_verdict(estimate, 2, device_bytes)


@pytest.mark.parametrize("n_devices", [2.5, 0, True])
def test_device_count_must_be_a_whole_number(n_devices):
    estimate = training_memory(124_000_000, "fp16")
    with pytest.raises(ValueError, match="n_devices must be an int"):
        estimate.per_device(n_devices)
    with pytest.raises(ValueError, match="n_devices must be an int"):
        memory_verdict(estimate, n_devices, 16 * GiB)


@pytest.mark.parametrize("gpu_gib, fragment", [(float("inf"), "finite"), (80e9, "looks like bytes"), (0, "> 0")])
def test_planner_gpu_memory_in_gib(gpu_gib, fragment):
    with pytest.raises(ValueError, match=fragment):
        plan("gpt2 (124M)", 1024, 8, gpu_gib, 4)


# --- data -------------------------------------------------------------------------------------------

def test_rank_true_is_not_rank_1():
    data = list(range(10))
    with pytest.raises(ValueError, match="rank=True"):
        DataPartitioner(data).use(True)
    with pytest.raises(ValueError, match="rank=True"):
        PartitionSampler(10, True, 2)
    with pytest.raises(ValueError, match="rank=True"):
        partition_dataset(True, 2, data, batch_size=2)
    with pytest.raises(ValueError, match="epoch=True"):
        PartitionSampler(10, 0, 2).set_epoch(True)


def test_collate_batch_given_a_default_collated_batch_says_what_to_do(tokenizer):
    pairs = load_corpus("train", 8)
    merged = next(iter(DataLoader(pairs, batch_size=4)))  # {"de": [...], "en": [...]}
    with pytest.raises(TypeError, match="default collate.*collate_fn=functools.partial"):
        collate_batch(merged, "de", "en", tokenizer, 32)
    loader = DataLoader(pairs, batch_size=4, collate_fn=functools.partial(
        collate_batch, src_key="de", tgt_key="en", tokenizer=tokenizer, model_max_length=32))
    assert next(iter(loader))["input_ids"].shape[0] == 4  # the way that works


def test_none_target_is_named(tokenizer, monkeypatch):
    with pytest.raises(TypeError, match=r"examples\[1\]\['en'\] must be a string, got None"):
        collate_batch([{"de": "Hallo", "en": "Hello"}, {"de": "Ja", "en": None}], "de", "en", tokenizer, 32)
    rows = [{"de": "Hallo", "en": "Hello"}, {"de": "Ja", "en": None}]
    fake = types.ModuleType("datasets")
    fake.load_dataset = lambda *args, **kwargs: {"translation": rows}
    monkeypatch.setitem(sys.modules, "datasets", fake)
    with pytest.raises(ValueError, match=r"row 1 of 'toy' \(train\) has no text for \['en'\]"):
        load_hf_translation("toy")
    assert load_hf_translation("toy", size=1) == [{"de": "Hallo", "en": "Hello"}]


def test_global_batch_that_does_not_divide_is_reported_before_ranks_start(monkeypatch, capsys):
    def must_not_start(*args, **kwargs):
        raise AssertionError("ranks were started")

    monkeypatch.setattr("parallel_lib.data_parallel.cli.run", must_not_start)
    with pytest.raises(SystemExit):
        dp_main(["--world-size", "3", "--batch-size", "32"])
    assert "does not divide evenly over world_size=3" in capsys.readouterr().err
