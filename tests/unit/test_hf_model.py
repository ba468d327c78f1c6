"""HFModel and the model registry: what they accept, and the clear errors for what they do not."""

from __future__ import annotations

import json

import pytest
import torch

from baige_ray.api.configs import TrainConfig
from baige_ray.engines.train_job import TrainJob
from baige_ray.models.hf import HFModel
from baige_ray.models.plugin import plugin_for
from baige_ray.models.token_dataset import TokenDataset
from baige_ray.parallel.layout import ParallelLayout
from tests.hf_helpers import SEQ_LEN, build_tiny_hf, llama_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_hf(tmp_path_factory.mktemp("tiny"))


def test_a_directory_without_config_json_is_refused(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        HFModel(tmp_path)


def test_a_path_that_is_not_a_local_directory_is_not_downloaded(tmp_path):
    with pytest.raises(ValueError, match="local directory"):
        HFModel("meta-llama/Llama-3-8B")


def test_an_unsupported_architecture_names_the_supported_ones():
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        HFModel.from_config({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 10})


def test_a_sequence_length_above_the_model_maximum_is_refused():
    with pytest.raises(ValueError, match="max_position_embeddings=128"):
        HFModel.from_config(llama_config(), seq_len=4096)


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tiny):
    with pytest.raises(ValueError, match="vocab_size=100"):
        HFModel.from_config(llama_config(vocab_size=100), tokenizer=tiny.tokenizer_dir)


def test_pickled_weights_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(llama_config().to_dict()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ValueError, match="safetensors"):
        HFModel(tmp_path)


def test_a_dataset_with_another_sequence_length_or_none_is_refused(tiny):
    model = HFModel(tiny.model_dir, seq_len=16)
    with pytest.raises(ValueError, match="seq_len"):
        plugin_for(model).open_data(TokenDataset.open(tiny.dataset_dir))
    with pytest.raises(ValueError, match="TokenDataset"):
        plugin_for(model).open_data(None)


def test_an_unknown_model_names_the_registered_families():
    with pytest.raises(ValueError, match=r"GPTConfig.*HFModel"):
        TrainJob(model=object(), train=TrainConfig(num_steps=1))


def test_tensor_parallel_degrees_must_divide_the_kv_heads(tiny):
    plugin = plugin_for(HFModel(tiny.model_dir, seq_len=SEQ_LEN))
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        plugin.check_layout(ParallelLayout(tp=4))
    assert set(plugin.tensor_parallel_plan(2)) == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                   "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}


def test_a_tied_last_stage_reads_the_embedding_the_checkpoint_stores_as_its_head(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(llama_config(tie_word_embeddings=True)).save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    assert "lm_head.weight" not in saved  # transformers writes the tied weight once
    plugin = plugin_for(HFModel(tmp_path, seq_len=SEQ_LEN))
    plugin.check_layout(ParallelLayout(pp=2))
    first, last = plugin.build_stages([(0, 2, True, False), (2, 4, False, True)], torch.device("cpu"), seed=0)
    assert last.lm_head.weight is last.model.embed_tokens.weight
    assert "lm_head.weight" not in dict(last.named_parameters())
    assert torch.equal(last.lm_head.weight, saved["model.embed_tokens.weight"])
    assert plugin.pipeline_tied_parameters(first) == [first.model.embed_tokens.weight]
    assert plugin.pipeline_tied_parameters(last) == [last.lm_head.weight]


def test_stages_keep_the_checkpoint_names_and_materialize_only_their_own_weights(tiny):
    from safetensors.torch import load_file

    plugin = plugin_for(HFModel(tiny.model_dir, seq_len=SEQ_LEN))
    saved = load_file(tiny.model_dir / "model.safetensors")
    (last,) = plugin.build_stages([(2, 4, False, True)], torch.device("cpu"), seed=0)
    names = {name for name, _ in last.named_parameters()}
    assert names == {name for name in saved if name.startswith(("model.layers.2.", "model.layers.3.", "model.norm",
                                                                  "lm_head"))}
    for name, param in last.named_parameters():
        assert torch.equal(param, saved[name]), name


def test_the_planner_prices_a_hf_model_from_its_config_and_the_model_can_run_its_pick():
    from baige_ray.planner.report import explain_text
    from baige_ray.runtime.auto_plan import layout_from_plan, plan_job
    from baige_ray.topology.descriptor import load_descriptor
    from baige_ray.topology.graph import ResourceGraph
    from tests.conftest import REPO_ROOT

    config = json.loads((REPO_ROOT / "examples" / "models" / "llama-3-8b.json").read_text())
    job = TrainJob(model=HFModel.from_config(config, seq_len=4096), train=TrainConfig(num_steps=1, global_batch_size=256))
    graph = ResourceGraph.from_descriptor(load_descriptor(REPO_ROOT / "clusters" / "dgx-a100-superpod.yaml"))
    chosen = plan_job(job, graph)
    assert "8.0B params" in explain_text(chosen)
    layout = layout_from_plan(chosen)
    job.plugin.check_layout(layout)  # the planner's degrees divide the model's heads, KV heads and FFN
    assert layout.tp in (1, 2, 4, 8) and layout.world_size <= graph.num_devices
