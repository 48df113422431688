"""The one shape type the planner uses counts real models' parameters exactly (issue #21, error 3).

Each model is built by Hugging Face's own classes on the meta device (no memory, no weights) and its
parameters counted, tied ones once; the planner's :func:`~parallel_lib.tensor_parallel.cost.shard_parameters`
must give the same number, and that number must be the published one: GPT-2's four sizes as
Hugging Face counts them (Radford et al. 2019's 117M/345M/762M/1542M were counted differently), and
Llama 3 8B, 70B and 405B (Llama Team 2024, table 3 for the shapes; 8.03B, 70.6B and 406B on their
Hugging Face model cards).
"""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from parallel_lib.planner.dry_run import meta_model
from parallel_lib.planner.layout import rank_parameters
from parallel_lib.planner.published import LLAMA3
from parallel_lib.cost.shape import GPTShape, shape_of
from parallel_lib.tensor_parallel.cost import shard_parameters, training_flops


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied weight is one parameter


@pytest.mark.parametrize("n_layer, n_embd, n_head, published", [
    (12, 768, 12, 124_439_808), (24, 1024, 16, 354_823_168), (36, 1280, 20, 774_030_080),
    (48, 1600, 25, 1_557_611_200)])
def test_gpt2_sizes_are_exact(n_layer, n_embd, n_head, published):
    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head)
    with torch.device("meta"):
        counted = _count(GPT2LMHeadModel(config))
    assert counted == shard_parameters(GPTShape.of(config), 1) == published


@pytest.mark.parametrize("name, published", [("8B", 8_030_261_248), ("70B", 70_553_706_496),
                                             ("405B", 405_853_388_800)])
def test_llama3_sizes_are_exact(name, published):
    shape = LLAMA3[name]
    counted = _count(meta_model(shape))  # Hugging Face's LlamaForCausalLM on the meta device
    assert counted == shard_parameters(shape, 1) == sum(rank_parameters(shape)) == published
    assert {"8B": round(published / 1e9, 2) == 8.03, "70B": round(published / 1e9, 1) == 70.6,
            "405B": round(published / 1e9) == 406}[name]  # the model cards' figures


def test_a_llama_pipeline_keeps_the_untied_head_once_on_the_last_stage():
    shape = LLAMA3["8B"]
    stages = rank_parameters(shape, tp=1, pp=4)
    assert sum(stages) == shard_parameters(shape, 1)  # no copy of a tied head to add
    assert stages[0] - stages[1] == stages[-1] - stages[1] - 4096 == 128_256 * 4096  # embedding / head (+ norm)
    with pytest.raises(ValueError, match="kv_heads=8"):
        shard_parameters(shape, 16)  # 32 query heads split 16 ways, but only 8 key/value heads


def test_the_flops_formula_is_narayanans_for_gpt_and_counts_swiglu_and_gqa_for_llama():
    gpt = GPTShape(24, 2048, 16, 51200, 2048)
    b, s, L, h, V = 4, 2048, 24, 2048, 51200  # Narayanan et al. 2021, eq. 3
    assert training_flops(gpt, b, s) == pytest.approx(72 * b * s * L * h * h * (1 + s / (6 * h) + V / (12 * h * L)))
    llama = LLAMA3["8B"]  # 6 FLOPs per parameter and token in the matrices, plus attention's 12·s·h per layer
    matrices = shard_parameters(llama, 1) - 128_256 * 4096 - 32 * 2 * 4096 - 4096  # less the embedding and norms
    assert training_flops(llama, 1, 4096) == 6 * 4096 * matrices + 12 * 4096 * 4096 * 32 * 4096


@pytest.mark.parametrize("name, published", [
    ("gpt2 (124M)", 124_439_808), ("gpt2-xl (1.5B)", 1_557_611_200),
    ("llama-2-7b", 6_738_415_616), ("llama-2-13b", 13_015_864_320), ("llama-2-70b", 68_976_648_192)])
def test_the_registry_counts_each_published_checkpoint(name, published):
    """Parameter counts as the Hugging Face checkpoints hold them (LLaMA-2: Touvron et al. 2023, table 1)."""
    shape = shape_of(name)
    counted = _count(meta_model(shape))  # GPT2LMHeadModel or LlamaForCausalLM on the meta device
    assert counted == shape.parameters() == published


def test_an_unknown_model_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="llama-3-8b"):
        shape_of("llama-3-9b")
