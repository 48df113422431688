"""The mixture-of-experts cost model: parameter counts against Hugging Face's Mixtral and DeepSeek-V3 classes and the
published literals, memory per GPU and all-to-all bytes against hand-computed values, bad input refused by name."""

from __future__ import annotations

import pytest
import torch

from parallel_lib.cost import DEEPSEEK_V3, MIXTRAL_8X7B, MoEShape, ep_traffic, moe_memory, moe_step_traffic
from parallel_lib.cost.moe import gqa_attention, mla_attention


def _hf_parameters(model_class, config) -> int:
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        return sum(p.numel() for p in model_class(config).parameters())


def test_the_shape_counts_what_hugging_faces_mixtral_and_deepseek_v3_hold():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, MixtralConfig, MixtralForCausalLM

    mixtral = MixtralConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    shape = MoEShape("small Mixtral", 2, 64, 100, gqa_attention(64, 4, 2), norms=2 * 64, n_experts=4, top_k=2,
                     expert_ffn=96, final_norm=64)
    assert shape.parameters() == _hf_parameters(MixtralForCausalLM, mixtral) == 185664
    deepseek = DeepseekV3Config(vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1,
                                num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
                                kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_group=1,
                                topk_group=1)
    shape = MoEShape("small DeepSeek-V3", 3, 64, 100, mla_attention(64, 4, 24, 16, 8, 4, 8), norms=2 * 64,
                     n_experts=8, top_k=2, expert_ffn=32, shared_experts=1, dense_layers=1, dense_ffn=96,
                     final_norm=64)
    assert shape.parameters() == _hf_parameters(DeepseekV3ForCausalLM, deepseek) == 164536


def test_mixtral_and_deepseek_v3_match_their_published_parameter_counts():
    # Mistral AI's "Mixtral of experts" (December 2023): 46.7B parameters, 12.9B used per token (the paper: 47B, 13B)
    assert MIXTRAL_8X7B.parameters() == pytest.approx(46.7e9, rel=0.01)
    assert MIXTRAL_8X7B.active_parameters() == pytest.approx(12.9e9, rel=0.01)
    # DeepSeek-V3 Technical Report, abstract and sec. 1: 671B parameters, 37B activated per token. Every parameter
    # a token reads, embeddings included (Mixtral's convention), is 37.55B: 1.5% above the literal
    assert DEEPSEEK_V3.parameters() == pytest.approx(671e9, rel=0.01)
    assert DEEPSEEK_V3.active_parameters() == pytest.approx(37e9, rel=0.016)
    assert DEEPSEEK_V3.active_parameters() - DEEPSEEK_V3.vocab_size * DEEPSEEK_V3.n_embd == pytest.approx(
        37e9, rel=0.011)  # without the input embedding (a lookup, no multiply): 36.63B, 1.0% below
    # by hand: one routed expert is three 7168 x 2048 matrices; 58 mixture layers of 256
    assert DEEPSEEK_V3.expert_parameters == 3 * 7168 * 2048
    assert DEEPSEEK_V3.routed_parameters() == 58 * 256 * 3 * 7168 * 2048
    assert DEEPSEEK_V3.rank_parameters(64) == DEEPSEEK_V3.replicated_parameters() + 58 * 4 * 3 * 7168 * 2048


def test_memory_per_gpu_shards_experts_over_ep_and_replicas_over_dp():
    # Mixtral, 8 GPUs, one expert each: replicated 1.6B (attention, norms, routers, embeddings) + 1/8 of the experts
    replicated, routed = MIXTRAL_8X7B.replicated_parameters(), MIXTRAL_8X7B.routed_parameters()
    assert replicated + routed == MIXTRAL_8X7B.parameters()
    m = moe_memory(MIXTRAL_8X7B, ep=8)
    assert m["total"] == 16 * (replicated + routed / 8) and m["parameters"] == replicated + routed / 8
    # dp 16 with ep 8: each expert has 2 copies, each replicated tensor 16; ZeRO-1 shards the 12 bytes over them
    z1 = moe_memory(MIXTRAL_8X7B, ep=8, dp=16, zero=1)
    assert z1["optimizer"] == pytest.approx(12 * replicated / 16 + 12 * routed / 8 / 2)
    assert z1["params"] == 2 * (replicated + routed / 8)
    assert moe_memory(DEEPSEEK_V3, ep=64, dp=128, pp=16, zero=1)["params"] == pytest.approx(
        2 * DEEPSEEK_V3.rank_parameters(64) / 16)


def test_step_traffic_is_every_mixture_layers_all_to_alls():
    one = ep_traffic(tokens=4096, top_k=8, hidden=7168, n_experts=256, ep=64, dtype_bytes=2)
    assert one.row_bytes == 4096 * 8 * 7168 * 2 and one.count_bytes == 256 * 8
    step = moe_step_traffic(DEEPSEEK_V3, tokens=4096, ep=64)
    assert (step.calls_forward, step.calls_backward) == (58 * 3, 58 * 2)
    assert step.wire_bytes == pytest.approx(58 * one.wire_bytes)
    assert moe_step_traffic(DEEPSEEK_V3, 4096, 64, layers=4).message_bytes == 4 * one.message_bytes


def test_bad_shapes_and_layouts_are_refused_by_name():
    with pytest.raises(ValueError, match="ep=3 must divide the 8 experts"):
        MIXTRAL_8X7B.rank_parameters(3)
    with pytest.raises(ValueError, match="ep=8 must divide dp=12"):
        moe_memory(MIXTRAL_8X7B, ep=8, dp=12)
    with pytest.raises(ValueError, match="top_k must be an int in 1..8"):
        MoEShape("x", 1, 8, 10, 0, 0, n_experts=8, top_k=9, expert_ffn=4)
    with pytest.raises(ValueError, match="n_head=3 must divide hidden=64"):
        gqa_attention(64, 3, 1)
    with pytest.raises(ValueError, match="layers must be an int in 0..58"):
        moe_step_traffic(DEEPSEEK_V3, 16, 8, layers=61)
