"""The reference GPT written as a GPT-2 directory: transformers loads it and computes the same logits."""

import pytest
import torch

from baige_ray.models.gpt import GPT, GPTConfig
from baige_ray.models.gpt_hf import gpt2_config_dict, write_gpt2_directory
from baige_ray.models.moe import MoEConfig


def test_transformers_gpt2_computes_the_reference_gpts_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = GPTConfig(num_layers=2, hidden=64, num_heads=2, seq_len=48, ffn_hidden=96)
    model = GPT(config).eval()
    with torch.no_grad():
        for param in model.parameters():  # biases and norms away from their zero/one initial values
            param.add_(0.05 * torch.randn_like(param))
    write_gpt2_directory(tmp_path, config, model.state_dict())
    converted = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, config.vocab_size, (3, config.seq_len))
    with torch.no_grad():
        torch.testing.assert_close(converted(tokens).logits, model(tokens), rtol=0, atol=1e-5)
    assert type(converted).__name__ == "GPT2LMHeadModel"


def test_a_mixture_of_experts_gpt_has_no_gpt2_form():
    with pytest.raises(ValueError, match="GPTConfig.moe"):
        gpt2_config_dict(GPTConfig(moe=MoEConfig(num_experts=4, top_k=2)))


def test_the_byte_tokenizer_reads_text_as_the_gpt_does(tmp_path):
    from transformers import AutoTokenizer

    write_gpt2_directory(tmp_path, GPTConfig(num_layers=1, hidden=32, num_heads=2))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    text = "def f(x):\n\treturn x + 'é' * 3  # 日本\x00"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8")) and tokenizer.decode(ids) == text and len(tokenizer) == 256
