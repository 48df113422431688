import pytest
import torch

from parallel_lib.common import GPT2_SIZES, build_gpt2, count_parameters, gpt2_config


def test_gpt2_shape_is_the_real_124m_model():
    # 124,439,808 is OpenAI GPT-2 small with its 50,257-token vocabulary and tied head
    config = gpt2_config("gpt2", vocab_size=50257)
    assert (config.n_embd, config.n_layer, config.n_head, config.n_positions) == (768, 12, 12, 1024)
    with torch.device("meta"):
        model = build_gpt2("gpt2", vocab_size=50257)
    assert count_parameters(model) == 124_439_808


def test_same_seed_same_weights_other_seed_other_weights():
    a, b, c = (build_gpt2("tiny", vocab_size=300, seed=s) for s in (7, 7, 8))
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=f"seed 7 twice differs at {name}")
    assert not torch.equal(a.transformer.wte.weight, c.transformer.wte.weight)


def test_building_a_model_leaves_the_callers_random_stream_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_gpt2("tiny", vocab_size=100, seed=5)
    torch.testing.assert_close(torch.rand(3), expected)


def test_no_dropout_so_training_mode_is_deterministic():
    model = build_gpt2("tiny", vocab_size=100).train()
    ids = torch.randint(0, 100, (2, 10))
    torch.testing.assert_close(model(input_ids=ids).logits, model(input_ids=ids).logits)


def test_tiny_trains_a_step_quickly_and_overrides_apply():
    model = build_gpt2("tiny", vocab_size=500, n_layer=2)
    assert model.config.n_layer == 2 and len(model.transformer.h) == 2
    ids = torch.randint(0, 500, (8, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    assert model.transformer.wte.weight.grad is not None


@pytest.mark.parametrize("name, vocab, match", [("huge", 100, "name must be one of"), ("tiny", 0, "vocab_size"),
                                                ("tiny", 2.5, "vocab_size")])
def test_bad_arguments(name, vocab, match):
    with pytest.raises(ValueError, match=match):
        gpt2_config(name, vocab_size=vocab)


def test_sizes_grow():
    widths = [GPT2_SIZES[n]["n_embd"] for n in ("tiny", "small", "gpt2")]
    assert widths == sorted(widths)
