"""ModelSpec from Hugging Face config.json: published sizes, exact counts against transformers, bad input."""

import json

import pytest
import torch
import transformers

from baige_ray.cli import main
from baige_ray.planner.model_spec import ModelSpec, load_model_spec

from ..conftest import REPO_ROOT

MODELS = REPO_ROOT / "examples" / "models"

# Published parameter counts (model cards / safetensors totals).
PUBLIC_SIZES = {"llama-3-8b": 8.03e9, "llama-3-70b": 70.6e9, "llama-3.1-405b": 405.9e9, "qwen2.5-72b": 72.7e9}

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=8,
            max_position_embeddings=128)


def _llama_dict(**overrides) -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
            "intermediate_size": 112, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 97,
            "max_position_embeddings": 128, **overrides}


def _without(key: str) -> dict:
    return {k: v for k, v in _llama_dict().items() if k != key}


def _transformers_count(config: transformers.PretrainedConfig) -> int:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(PUBLIC_SIZES))
def test_shipped_configs_parse_in_transformers_and_match_published_sizes(name):
    data = json.loads((MODELS / f"{name}.json").read_text())
    config = transformers.AutoConfig.for_model(**data)
    assert type(config).__name__ == {"llama": "LlamaConfig", "qwen2": "Qwen2Config"}[data["model_type"]]
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (
        data["hidden_size"], data["num_hidden_layers"], data["vocab_size"])
    spec = load_model_spec(MODELS / f"{name}.json")
    assert spec.name == name
    assert spec.num_params == pytest.approx(PUBLIC_SIZES[name], rel=0.02)
    assert (spec.gated_mlp, spec.rms_norm, spec.learned_positions, spec.tied_embeddings) == (True, True, False, False)
    assert (spec.seq_len, spec.global_batch, spec.dtype_bytes) == (4096, 1024, 2)


@pytest.mark.parametrize("config", [
    transformers.LlamaConfig(**TINY, num_key_value_heads=2),
    transformers.LlamaConfig(**TINY, num_key_value_heads=4, tie_word_embeddings=True),
    transformers.LlamaConfig(**TINY, num_key_value_heads=2, head_dim=24),
    transformers.MistralConfig(**TINY, num_key_value_heads=4),
    transformers.MixtralConfig(**TINY, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
], ids=["llama-gqa", "llama-tied", "llama-head-dim", "mistral", "mixtral"])
def test_count_equals_transformers_parameters_exactly(config):
    spec = ModelSpec.from_hf_config(config.to_dict(), global_batch=8)
    assert spec.num_params == _transformers_count(config)


def test_hf_fields_map_onto_the_spec():
    spec = ModelSpec.from_hf_config(_llama_dict(num_key_value_heads=2, head_dim=32, torch_dtype="float32",
                                                tie_word_embeddings=True), global_batch=8, seq_len=64)
    assert (spec.name, spec.kv_heads, spec.head_dim, spec.q_dim, spec.kv_dim) == ("LlamaForCausalLM", 2, 32, 128, 64)
    assert (spec.seq_len, spec.dtype_bytes, spec.output_params) == (64, 4, 64)
    assert ModelSpec.from_hf_config(_llama_dict(head_dim=16), global_batch=8).head_dim is None
    assert ModelSpec.from_hf_config(_llama_dict(dtype="float16"), global_batch=8, dtype_bytes=4).dtype_bytes == 4
    qwen_moe = ModelSpec.from_hf_config(
        _llama_dict(model_type="qwen3_moe", architectures=None, num_experts=8, num_experts_per_tok=2,
                    moe_intermediate_size=48), global_batch=8)
    assert (qwen_moe.name, qwen_moe.num_experts, qwen_moe.top_k, qwen_moe.expert_ffn) == ("qwen3_moe", 8, 2, 48)
    assert qwen_moe.expert_layer_params == 8 * 3 * 64 * 48


def test_gated_flops_count_three_matrices_and_attention_over_q_dim():
    spec = ModelSpec.from_hf_config(_llama_dict(num_key_value_heads=2, head_dim=32), global_batch=8, seq_len=16)
    attention = 2 * 64 * 128 + 2 * 64 * 64
    assert spec.layer_flops_per_token == 2.0 * (attention + 3 * 64 * 112) + 4.0 * 16 * 128
    assert spec.logits_flops_per_token == 2.0 * 64 * 97


@pytest.mark.parametrize(("config", "match"), [
    (_llama_dict(hidden_size=None), r"hidden_size=None is invalid"),
    (_without("num_hidden_layers"), r"config of LlamaForCausalLM lacks the required key 'num_hidden_layers'"),
    (_without("max_position_embeddings"), r"lacks the required key 'max_position_embeddings'"),
    (_llama_dict(model_type="gpt2"), r"model_type='gpt2' is invalid: expected one of llama"),
    (_llama_dict(torch_dtype="int8"), r"torch_dtype='int8' is invalid"),
    (_llama_dict(dtype="float64"), r"dtype='float64' is invalid"),
    (_llama_dict(tie_word_embeddings="yes"), r"tie_word_embeddings='yes' is invalid"),
    (_llama_dict(vocab_size=1.5), r"vocab_size=1.5 is invalid"),
    (_llama_dict(head_dim=0), r"head_dim=0 is invalid"),
    (_llama_dict(num_local_experts=4), r"lacks the required key 'num_experts_per_tok'"),
    (_llama_dict(num_key_value_heads=3), r"ModelSpec.num_kv_heads=3 is invalid"),
    (["not", "a", "mapping"], r"expected a mapping"),
])
def test_bad_hf_configs_raise_naming_the_key(config, match):
    with pytest.raises(ValueError, match=match):
        ModelSpec.from_hf_config(config, global_batch=8)


def test_new_fields_are_validated_and_head_dim_lifts_the_divisibility_rule():
    shape = dict(num_layers=2, hidden=60, ffn_hidden=128, num_heads=8, seq_len=8, vocab_size=16, global_batch=4)
    with pytest.raises(ValueError, match=r"ModelSpec.hidden=60 is invalid"):
        ModelSpec(**shape)
    assert ModelSpec(**shape, head_dim=16).q_dim == 128
    with pytest.raises(ValueError, match=r"ModelSpec.head_dim=0 is invalid"):
        ModelSpec(**shape, head_dim=0)
    for field in ("gated_mlp", "learned_positions", "tied_embeddings", "rms_norm"):
        with pytest.raises(ValueError, match=rf"ModelSpec.{field}=1 is invalid: expected True or False"):
            ModelSpec(**shape, head_dim=16, **{field: 1})


def test_load_model_spec_reads_a_model_directory_and_names_the_file(tmp_path):
    model_dir = tmp_path / "Tiny-Llama"
    model_dir.mkdir()
    with pytest.raises(ValueError, match=r"a directory must hold a Hugging Face config.json"):
        load_model_spec(model_dir)
    (model_dir / "config.json").write_text(json.dumps(_llama_dict(max_position_embeddings=16384)))
    spec = load_model_spec(model_dir, global_batch=64)
    assert (spec.name, spec.seq_len, spec.global_batch) == ("Tiny-Llama", 4096, 64)
    assert load_model_spec(model_dir / "config.json", seq_len=512).seq_len == 512
    (model_dir / "config.json").write_text(json.dumps(_llama_dict(vocab_size=0)))
    with pytest.raises(ValueError, match=r"config.json: Hugging Face config of .* vocab_size=0 is invalid"):
        load_model_spec(model_dir)
    with pytest.raises(ValueError, match=r"seq_len=512 is invalid for the model YAML"):
        load_model_spec(MODELS / "gpt-small.yaml", seq_len=512)


def test_plan_cli_plans_a_hugging_face_config(capsys):
    cluster = str(REPO_ROOT / "clusters" / "h100-rail-2048.yaml")
    code = main(["plan", str(MODELS / "llama-3-70b.json"), "--cluster", cluster, "--json", "--global-batch", "512"])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (result["model"], result["num_ranks"]) == ("llama-3-70b", 16384)
    assert result["dp"] * result["micro_batch_size"] * result["num_micro_batches"] == 512
    assert main(["plan", str(MODELS / "gpt-small.yaml"), "--cluster", str(REPO_ROOT / "clusters" / "sim-2x4.yaml"),
                 "--seq-len", "64"]) == 2
    assert "for Hugging Face config.json only" in capsys.readouterr().err


@pytest.mark.parametrize("config", [
    transformers.Qwen2MoeConfig(**TINY, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=48, shared_expert_intermediate_size=80),
    transformers.Qwen3MoeConfig(**TINY, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=48, mlp_only_layers=[0], head_dim=8),
], ids=["qwen2-moe-shared-expert", "qwen3-moe-dense-first-layer"])
def test_moe_counts_take_shared_experts_and_dense_layers_into_account(config):
    spec = ModelSpec.from_hf_config(config.to_dict(), global_batch=8)
    # Left out (module doc): Qwen2's Q/K/V biases and shared-expert gate, Qwen3's Q/K norms: < 200 per layer here.
    assert spec.num_params == pytest.approx(_transformers_count(config), abs=3 * 200)


def test_dense_layers_and_shared_experts_change_what_the_planner_prices():
    base = dict(num_layers=4, hidden=256, ffn_hidden=1024, num_heads=8, seq_len=128, vocab_size=1000,
                global_batch=8, num_experts=8, top_k=2, expert_ffn_hidden=512)
    routed_only = ModelSpec(**base)
    mixed = ModelSpec(**base, num_dense_layers=1, shared_expert_ffn=512)
    assert mixed.expert_layer_params == pytest.approx(0.75 * routed_only.expert_layer_params)
    dense_mlp, shared_mlp = 2 * 256 * 1024, 2 * 256 * 512
    assert mixed.dense_layer_params - routed_only.dense_layer_params == pytest.approx(
        0.25 * (dense_mlp - 256 * 8) + 0.75 * shared_mlp)
    assert mixed.layer_flops_per_token == pytest.approx(
        routed_only.layer_flops_per_token + 2 * (0.25 * (dense_mlp - 256 * 8 - 2 * 2 * 256 * 512) + 0.75 * shared_mlp))
    with pytest.raises(ValueError, match="ModelSpec.num_dense_layers=4 is invalid"):
        ModelSpec(**base, num_dense_layers=4)
