"""The conformance matrix in transformers alone: each published config.json, shrunk with every flag kept, builds,
runs forward and greedy generation, and survives save_pretrained/from_pretrained with the same logits."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from baige_ray.models.hf.conformance import (EXTRA_CONFIGS, MODELS_DIR, PUBLISHED_CONFIGS, SIZE_KEYS, flags_of,
                                              load_published, shrink_config, sparse_layers)

VOCAB = 97
CONFIGS = {**{name: arch for arch, name in PUBLISHED_CONFIGS.items()}, **EXTRA_CONFIGS}
README_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                        "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"}


def build(config: dict, seed: int = 0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32).eval()


def tokens(batch: int = 2, seq: int = 24) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits


def test_one_published_config_per_readme_architecture_and_together_every_flag():
    assert set(PUBLISHED_CONFIGS) == README_ARCHITECTURES
    flags = {name: flags_of(load_published(name)) for name in CONFIGS}
    assert all(flags[name]["architecture"] == arch for name, arch in CONFIGS.items())

    def covered(key, value):
        return [name for name, flag in flags.items() if flag[key] == value]

    assert covered("tied_embeddings", True) and covered("rope", "llama3") and covered("rope", "yarn")
    assert covered("attention_bias", True) and covered("qk_norm", True) and covered("sliding_window", True)
    assert covered("head_dim_apart", True) and covered("shared_experts", True)
    assert covered("norm_topk_prob", True) and covered("norm_topk_prob", False)
    assert covered("attention", "MHA") and covered("attention", "GQA")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_shrink_keeps_every_published_key_and_changes_only_sizes(name):
    published = load_published(name)
    assert json.loads((MODELS_DIR / name).read_text()) == published
    tiny = shrink_config(published, vocab_size=VOCAB)
    assert set(tiny) == set(published)
    changed = {key for key in published if tiny[key] != published[key]}
    assert changed <= SIZE_KEYS, changed - SIZE_KEYS
    assert flags_of(tiny) == flags_of(published)
    assert (tiny["hidden_size"], tiny["num_attention_heads"], tiny["vocab_size"]) == (64, 4, VOCAB)
    assert tiny["max_position_embeddings"] == 256 and tiny["num_hidden_layers"] == 4
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert tiny.get(key) is None
    with_ids = shrink_config(published, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    assert (with_ids["bos_token_id"], with_ids["eos_token_id"], with_ids["pad_token_id"]) == (1, 2, 0)
    assert shrink_config(published, vocab_size=VOCAB, hidden_size=128).get("head_dim") in (None, 32, 64)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tiny_model_builds_runs_generates_and_round_trips(name, tmp_path):
    config = shrink_config(load_published(name), vocab_size=VOCAB)
    model = build(config)
    assert type(model).__name__ == CONFIGS[name]
    ids = tokens()
    out = logits(model, ids)
    assert out.shape == (2, 24, VOCAB) and torch.isfinite(out).all()
    generated = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=4)
    assert generated.shape == (2, 28) and torch.equal(generated[:, :24], ids)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert torch.equal(logits(reloaded, ids), out)
    if config.get("tie_word_embeddings"):
        assert reloaded.lm_head.weight.data_ptr() == reloaded.get_input_embeddings().weight.data_ptr()


@pytest.mark.parametrize("name", [n for n in sorted(CONFIGS) if flags_of(load_published(n))["rope"] != "default"])
def test_rope_scaling_still_acts_in_the_tiny_model(name):
    config = shrink_config(load_published(name), vocab_size=VOCAB)
    plain = {key: value for key, value in config.items() if key != "rope_scaling"}
    ids = tokens()
    assert not torch.allclose(logits(build(config), ids), logits(build(plain), ids), atol=1e-4)


@pytest.mark.parametrize("name", [n for n in sorted(CONFIGS) if flags_of(load_published(n))["sliding_window"]])
def test_sliding_window_masks_inside_the_training_length(name):
    config = shrink_config(load_published(name), vocab_size=VOCAB)
    window = config["sliding_window"]
    assert window < 24
    ids = tokens()
    windowed, full = build(config), build({**config, "sliding_window": None})
    a, b = logits(windowed, ids), logits(full, ids)
    torch.testing.assert_close(a[:, :window], b[:, :window])
    assert not torch.allclose(a[:, window:], b[:, window:], atol=1e-4)


# No published Qwen2-MoE/Qwen3-MoE checkpoint has dense layers (all ship decoder_sparse_step 1, mlp_only_layers
# []): these variants of the published files keep that code path and its shrinking covered.
@pytest.mark.parametrize("name, overrides, dense", [
    ("qwen1.5-moe-a2.7b.json", {"decoder_sparse_step": 2}, [0, 2]),
    ("qwen3-30b-a3b.json", {"mlp_only_layers": [0, 1, 2, 3, 4, 5]}, [0]),
])
def test_dense_layers_between_sparse_ones_survive_the_shrink(name, overrides, dense):
    config = shrink_config({**load_published(name), **overrides}, vocab_size=VOCAB)
    assert [i for i in range(4) if i not in sparse_layers(config)] == dense
    assert flags_of(config)["dense_layers"] == len(dense)
    model = build(config)
    experts = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    assert experts == sparse_layers(config)
    assert torch.isfinite(logits(model, tokens())).all()


def test_the_documented_support_table_is_the_generated_one():
    from baige_ray.models.hf.conformance import support_table

    guide = (MODELS_DIR.parents[1] / "docs" / "guides" / "hf-models.md").read_text()
    assert support_table() in guide, "regenerate with: python -c 'from baige_ray.models.hf.conformance " \
                                      "import support_table; print(support_table())'"
