import math

import pytest
import torch

from baige_ray.models.gpt import GPT, GPTConfig, generate, language_model_loss

TINY = GPTConfig(seq_len=16, num_layers=2, num_heads=2, hidden=32)


def test_logits_shape_and_initial_loss_near_uniform():
    torch.manual_seed(0)
    model = GPT(TINY)
    tokens = torch.randint(0, 256, (3, 16))
    logits = model(tokens)
    assert logits.shape == (3, 16, 256)
    loss = language_model_loss(logits, tokens).item()
    assert abs(loss - math.log(256)) < 0.3


def test_attention_is_causal():
    torch.manual_seed(0)
    model = GPT(TINY).eval()
    tokens = torch.randint(0, 256, (1, 16))
    changed = tokens.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 256
    before, after = model(tokens), model(changed)
    assert torch.allclose(before[0, :10], after[0, :10], atol=1e-6)
    assert not torch.allclose(before[0, 10:], after[0, 10:], atol=1e-6)


def test_generate_extends_prompt_deterministically_with_generator():
    torch.manual_seed(0)
    model = GPT(TINY)
    prompt = torch.tensor([[104, 105]])
    first = generate(model, prompt, 20, generator=torch.Generator().manual_seed(1))
    second = generate(model, prompt, 20, generator=torch.Generator().manual_seed(1))
    assert first.shape == (1, 22)
    assert torch.equal(first, second)
    assert torch.equal(first[:, :2], prompt)


def test_same_seed_same_weights():
    torch.manual_seed(7)
    a = GPT(TINY)
    torch.manual_seed(7)
    b = GPT(TINY)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_parameter_count_matches_formula():
    h, layers, vocab, seq = TINY.hidden, TINY.num_layers, TINY.vocab_size, TINY.seq_len
    per_block = 4 * (h * h + h) + (h * 4 * h + 4 * h) + (4 * h * h + h) + 2 * 2 * h
    expected = vocab * h + seq * h + layers * per_block + 2 * h + vocab * h
    assert GPT(TINY).num_parameters() == expected


def test_ffn_hidden_overrides_default():
    assert GPTConfig(hidden=32, num_heads=2, ffn_hidden=48).mlp_hidden == 48
    with pytest.raises(ValueError, match="ffn_hidden"):
        GPTConfig(ffn_hidden=0)
