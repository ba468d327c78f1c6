"""Mixture-of-experts Hugging Face models in baige-ray's stages: the same logits and router loss as transformers."""

import pytest
import torch

from baige_ray.models.aux_loss import auxiliary_losses
from baige_ray.models.hf import HFModel
from baige_ray.models.hf.export import save_hf_checkpoint
from baige_ray.models.hf.moe import RoutedExperts
from baige_ray.models.plugin import plugin_for
from baige_ray.parallel.layout import ParallelLayout

SHAPE = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, tie_word_embeddings=False, output_router_logits=True)


def mixtral():
    from transformers import MixtralConfig

    return MixtralConfig(**SHAPE, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
                         router_aux_loss_coef=0.05)


def qwen3_moe():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**SHAPE, intermediate_size=96, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                          router_aux_loss_coef=0.05, norm_topk_prob=True, head_dim=16)


def qwen2_moe():
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(**SHAPE, intermediate_size=96, moe_intermediate_size=48, shared_expert_intermediate_size=64,
                          num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.05)


def whole_stage(model: HFModel):
    torch.manual_seed(0)
    return plugin_for(model).build_stages([(0, model.config["num_hidden_layers"], True, True)], torch.device("cpu"),
                                          seed=0)[0]


@pytest.mark.parametrize("family", [mixtral, qwen3_moe, qwen2_moe])
def test_stage_computes_transformers_logits_and_router_loss(family):
    from transformers import AutoModelForCausalLM

    model = HFModel.from_config(family(), seq_len=32)
    stage = whole_stage(model)
    assert all(isinstance(layer.mlp.experts, RoutedExperts) for layer in stage.layers.values())
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(model.transformers_config(), dtype=torch.float32)
    tokens = torch.randint(0, 128, (3, 32))
    expected = reference(tokens, output_router_logits=True)
    with auxiliary_losses() as aux:
        logits = stage(tokens)
    torch.testing.assert_close(logits, expected.logits, rtol=0, atol=1e-5)
    assert aux.total == pytest.approx(0.05 * expected.aux_loss.item(), rel=1e-6)


def test_export_writes_experts_one_by_one_and_transformers_loads_it(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = HFModel.from_config(mixtral(), seq_len=32)
    stage = whole_stage(model)
    save_hf_checkpoint(tmp_path, stage.state_dict(), model, step=3)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as handle:
        names = set(handle.keys())
    assert "model.layers.1.block_sparse_moe.experts.2.w3.weight" in names
    assert not any(name.endswith("gate_up_proj") for name in names)
    tokens = torch.randint(0, 128, (2, 32))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(loaded(tokens).logits, stage(tokens), rtol=0, atol=1e-5)
    reread = whole_stage(HFModel(tmp_path, seq_len=32))  # through transformers' loader, which fuses the experts
    torch.testing.assert_close(reread(tokens), stage(tokens), rtol=0, atol=0)


def test_layouts_the_router_loss_or_the_expert_count_rule_out():
    plugin = plugin_for(HFModel.from_config(mixtral(), seq_len=32))
    with pytest.raises(ValueError, match="ParallelLayout.ep=8 is invalid: expected a divisor of the model's 4 experts"):
        plugin.check_layout(ParallelLayout(dp=8, ep=8))
    with pytest.raises(ValueError, match="output_router_logits"):
        plugin.check_layout(ParallelLayout(pp=2))
    assert plugin.max_pipeline_stages == 1
    without_loss = plugin_for(HFModel.from_config(mixtral().to_dict() | {"output_router_logits": False}, seq_len=32))
    assert not without_loss.has_auxiliary_loss and without_loss.max_pipeline_stages is None
    without_loss.check_layout(ParallelLayout(pp=2))
    from tests.hf_helpers import llama_config

    with pytest.raises(ValueError, match="the model has no experts"):
        plugin_for(HFModel.from_config(llama_config(), seq_len=32)).check_layout(ParallelLayout(dp=2, ep=2))


def test_the_builtin_engine_serves_mixtral_with_its_kv_cache_as_without_one():
    from baige_ray.models.hf.decoding import HFDecoder
    from baige_ray.serving.causal_lm_generation import SamplingParams, generate_batch
    from baige_ray.serving.engine import ContinuousBatchingEngine, EngineLimits, generate_all

    plugin = plugin_for(HFModel.from_config(mixtral(), seq_len=64))
    torch.manual_seed(0)
    model = plugin.build_inference_model(plugin.build_model().state_dict())  # what a serving replica runs
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (n,), generator=generator).tolist() for n in (3, 11, 1, 7)]
    params = [SamplingParams(max_new_tokens=n, temperature=0.0) for n in (9, 4, 12, 6)]
    engine = ContinuousBatchingEngine(HFDecoder(model, 64), eos_token_id=None, limits=EngineLimits(max_batch_size=3))
    uncached = [generate_batch(model, [prompt], [p], eos_token_id=None, max_context=64, use_cache=False)[0]
                for prompt, p in zip(prompts, params)]
    assert generate_all(engine, prompts, params) == uncached


def test_vllm_is_refused_for_moe_models_with_the_reason():
    plugin = plugin_for(HFModel.from_config(mixtral(), seq_len=32))
    from baige_ray.serving.vllm_engine import build_vllm_engine

    for refuse in (plugin.check_vllm, lambda: build_vllm_engine(plugin, {}, None)):
        with pytest.raises(ValueError, match="in-place weight update.*engine='builtin'"):
            refuse()


def test_pipeline_stages_split_a_qwen3_moe_by_cost_when_its_first_layers_are_dense():
    config = qwen3_moe().to_dict() | {"num_hidden_layers": 4, "mlp_only_layers": [0, 1], "output_router_logits": False,
                                      "moe_intermediate_size": 512}
    plugin = plugin_for(HFModel.from_config(config, seq_len=32))
    costs = plugin.layer_costs()
    assert costs[0] == costs[1] < costs[2] == costs[3]
    assert plugin.layers_per_stage(ParallelLayout(pp=2)) == (3, 1)
