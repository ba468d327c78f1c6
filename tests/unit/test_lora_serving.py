"""LoRA adapters served by the built-in engine: each request names its adapter (or none), rows of several
adapters decode in one batch, and each generates the greedy tokens of peft + transformers on the same
directories; an adapter from a training job's memory serves as its directory does."""

import pytest
import torch


@pytest.fixture(scope="module")
def base_and_adapters(tmp_path_factory):
    """A tiny Llama and two PEFT adapters of it with random (non-zero) B matrices, as peft saves them."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.hf_helpers import llama_config

    root = tmp_path_factory.mktemp("lora-serving")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(llama_config(), dtype=torch.float32).save_pretrained(root / "base")
    adapters = {}
    for index, targets in enumerate((["q_proj", "v_proj"], ["o_proj", "down_proj", "up_proj"])):
        torch.manual_seed(10 + index)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32),
                               LoraConfig(r=4, lora_alpha=16, target_modules=targets, lora_dropout=0.0))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.3)
        model.save_pretrained(root / f"adapter-{index}")
        adapters[f"adapter-{index}"] = root / f"adapter-{index}"
    return root / "base", adapters


def peft_greedy(base_dir, adapter_dir, prompt: list[int], new_tokens: int) -> list[int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    output = model.eval().generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                                   min_new_tokens=new_tokens, pad_token_id=0)
    return output[0, len(prompt):].tolist()


def engine_over(base_dir, adapters: dict):
    from transformers import AutoModelForCausalLM

    from baige_ray.models.hf.decoding import HFDecoder
    from baige_ray.serving.engine import ContinuousBatchingEngine
    from baige_ray.serving.lora_adapters import AdapterSet

    decoder = HFDecoder(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), max_context=128)
    served = AdapterSet(decoder.model)
    for name, weights in adapters.items():
        served.add(name, weights)
    return ContinuousBatchingEngine(decoder, eos_token_id=None, adapters=served)


def test_rows_of_several_adapters_in_one_batch_generate_peft_greedy_tokens(base_and_adapters):
    from baige_ray.serving.causal_lm_generation import SamplingParams
    from baige_ray.serving.engine import generate_all
    from baige_ray.serving.lora_adapters import read_peft_adapter

    base_dir, adapter_dirs = base_and_adapters
    engine = engine_over(base_dir, {name: read_peft_adapter(path) for name, path in adapter_dirs.items()})
    prompts = [[5, 17, 33, 2], [5, 17, 33, 2], [5, 17, 33, 2], [9, 9, 40], [9, 9, 40, 41, 42]]
    names = [None, "adapter-0", "adapter-1", "adapter-1", "adapter-0"]
    generations = generate_all(engine, prompts, [SamplingParams(max_new_tokens=8, temperature=0.0)] * 5, names)
    expected = [peft_greedy(base_dir, None if name is None else adapter_dirs[name], prompt, 8)
                for prompt, name in zip(prompts, names)]
    assert [g.tokens for g in generations] == expected
    assert len({tuple(tokens) for tokens in expected[:3]}) == 3, "the adapters change what the model says"
    with pytest.raises(ValueError, match="adapter 'missing' is not served: expected one of"):
        engine.submit([1, 2], SamplingParams(max_new_tokens=2, adapter="missing"), lambda event: None)


def test_an_adapter_from_a_training_jobs_memory_serves_as_its_directory_does(base_and_adapters):
    from safetensors.torch import load_file

    from baige_ray.serving.causal_lm_generation import SamplingParams
    from baige_ray.serving.engine import generate_all
    from baige_ray.serving.lora_adapters import lora_weights_from_state, read_peft_adapter

    base_dir, adapter_dirs = base_and_adapters
    saved = load_file(str(adapter_dirs["adapter-0"] / "adapter_model.safetensors"))
    # As a job's weights name them: canonical names with peft's adapter name.
    in_memory = {key.removeprefix("base_model.model.").replace(".weight", ".default.weight"): tensor
                 for key, tensor in saved.items()}
    from_memory = engine_over(base_dir, {"tuned": lora_weights_from_state(in_memory, lora_alpha=16, r=4)})
    from_disk = engine_over(base_dir, {"tuned": read_peft_adapter(adapter_dirs["adapter-0"])})
    params = [SamplingParams(max_new_tokens=6, temperature=0.0)]
    assert [g.tokens for g in generate_all(from_memory, [[3, 4, 5]], params, ["tuned"])] == \
        [g.tokens for g in generate_all(from_disk, [[3, 4, 5]], params, ["tuned"])]


def test_requests_name_an_adapter_alone_or_after_the_model_and_models_lists_it(base_and_adapters):
    from baige_ray.serving.lora_adapters import served_adapters
    from baige_ray.serving.openai_api import CompletionLimits, parse_completion_request
    from baige_ray.serving.openai_responses import models_response
    from baige_ray.serving.requests import RequestError

    def adapter_of(model):
        body = ('{"prompt": "x", "model": "%s"}' % model).encode()
        return parse_completion_request(body, CompletionLimits(), model_name="base", adapters=("tuned",)).sampling.adapter

    assert adapter_of("base") is None and adapter_of("tuned") == adapter_of("base:tuned") == "tuned"
    with pytest.raises(RequestError, match="The model `other` does not exist"):
        adapter_of("other")
    listed = models_response("base", 0, root="/models/base", max_model_len=128, adapters={"tuned": "/adapters/t"})
    assert [(card["id"], card["root"], card["parent"]) for card in listed["data"]] == [
        ("base", "/models/base", None), ("tuned", "/adapters/t", "base")]
    _, adapter_dirs = base_and_adapters
    assert served_adapters({"a": adapter_dirs["adapter-0"]}) == {"a": str(adapter_dirs["adapter-0"].resolve())}
    with pytest.raises(ValueError, match="expected a PEFT adapter directory"):
        served_adapters({"a": adapter_dirs["adapter-0"].parent})
    with pytest.raises(ValueError, match="without ':'"):
        served_adapters({"a:b": adapter_dirs["adapter-0"]})
