"""A trained Hugging Face model leaves as a directory `transformers` loads, and is served over HTTP.

The tiny Llama trains as an elastic job; its final checkpoint is a Hugging Face directory whose
logits equal the trained state's, and `serve()` hosts it (with its tokenizer, a KV cache and
continuous batching) behind the OpenAI-compatible routes, whole and streamed, beside /generate.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
import ray
import torch

from baige_ray.api.elastic import ElasticConfig
from baige_ray.models.plugin import plugin_for
from baige_ray.serving import reload_weights, serve, shutdown
from baige_ray.serving.generators import text_generator
from baige_ray.serving.requests import GenerateRequest
from tests.hf_helpers import build_tiny_hf, elastic_hf_run
from tests.helpers import free_port
from tests.ray.test_serving import call


@pytest.fixture(scope="module")
def trained(local_ray, tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-llama-export")
    tiny = build_tiny_hf(root)
    job = elastic_hf_run("hf-export", root / "runs", tiny, num_workers=2, num_steps=6,
                         elastic=ElasticConfig(num_spares=0), global_batch_size=8)
    return job.model, job.wait()


@pytest.fixture(scope="module")
def app(trained):
    _, result = trained
    info = serve(result.checkpoint_path, name="tiny-llama", port=free_port())
    yield info
    shutdown(info)


def test_the_final_checkpoint_loads_in_transformers_with_the_trained_logits(trained):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, result = trained
    trained_state = ray.get(result.final_state)["model"]
    ours = plugin_for(model).build_inference_model(trained_state)
    loaded = AutoModelForCausalLM.from_pretrained(result.checkpoint_path).eval()
    assert AutoTokenizer.from_pretrained(result.checkpoint_path).decode([5, 6]) == model.load_tokenizer().decode([5, 6])
    batch = torch.randint(0, model.vocab_size, (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=batch).logits, ours(input_ids=batch).logits, rtol=1e-5, atol=1e-5)


def test_v1_completions_answers_in_openai_shape_with_the_kv_cached_greedy_tokens(trained, app):
    model, result = trained
    status, reply = call(f"{app.url}/v1/completions",
                         {"model": "tiny-llama", "prompt": "def parse(", "max_tokens": 12, "temperature": 0})
    assert status == 200, reply
    assert reply["object"] == "text_completion" and reply["model"] == "tiny-llama"
    (choice,) = reply["choices"]
    assert choice["finish_reason"] in ("stop", "length")
    assert reply["usage"]["completion_tokens"] <= 12
    generator = text_generator(plugin_for(model), ray.get(result.final_state)["model"])
    (expected,) = generator.generate([GenerateRequest(prompt="def parse(", max_new_tokens=12, temperature=0.0)])
    assert choice["text"] == expected.text
    status, generated = call(f"{app.url}/generate", {"prompt": "def parse(", "max_new_tokens": 12, "temperature": 0})
    assert (status, generated["text"]) == (200, expected.text)


@pytest.mark.parametrize(("body", "status"), [
    (b"{not json", 400),
    ({"prompt": 3}, 400),
    ({"prompt": "x", "max_tokens": 10**9}, 400),
    ({"prompt": "x", "model": "some-other-model"}, 404),
    ({"prompt": "x", "stream": "yes"}, 400),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400),
])
def test_malformed_completions_get_a_4xx_with_a_reason(app, body, status):
    code, reply = call(f"{app.url}/v1/completions", body)
    assert code == status and reply["error"]["message"], reply


def server_sent_events(url: str, body: dict) -> list:
    """The `data:` payloads of a streamed response, JSON-decoded ("[DONE]" kept as is)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        lines = response.read().decode().split("\n\n")
    payloads = [line.removeprefix("data: ") for line in lines if line]
    return [payload if payload == "[DONE]" else json.loads(payload) for payload in payloads]


def test_a_streamed_completion_sends_the_same_text_as_the_whole_one(app):
    body = {"model": "tiny-llama", "prompt": "def parse(", "max_tokens": 12, "temperature": 0}
    whole = call(f"{app.url}/v1/completions", body)[1]
    events = server_sent_events(f"{app.url}/v1/completions",
                                {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]" and events[-2]["usage"] == whole["usage"]
    chunks = events[:-2]
    assert len(chunks) > 2 and all(chunk["object"] == "text_completion" for chunk in chunks)
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


def test_chat_completions_whole_and_streamed(app):
    body = {"model": "tiny-llama", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f("}]}
    status, whole = call(f"{app.url}/v1/chat/completions", body)
    assert status == 200 and whole["object"] == "chat.completion", whole
    message = whole["choices"][0]["message"]
    assert message["role"] == "assistant" and whole["usage"]["completion_tokens"] >= 1
    events = server_sent_events(f"{app.url}/v1/chat/completions", {**body, "stream": True})
    assert events[-1] == "[DONE]" and events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    chunks = events[1:-1]
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks) == message["content"]
    status, reply = call(f"{app.url}/v1/chat/completions", {**body, "messages": [{"role": "robot", "content": "x"}]})
    assert status == 400 and "role" in reply["error"]["message"]


def test_v1_models_lists_the_served_model(app):
    status, reply = call(f"{app.url}/v1/models")
    assert status == 200 and [model["id"] for model in reply["data"]] == ["tiny-llama"]


def test_weights_from_memory_replace_the_served_checkpoint_in_place(trained, app):
    model, result = trained
    state = ray.get(result.final_state)["model"]
    zeroed = {name: torch.zeros_like(tensor) if name == "lm_head.weight" else tensor for name, tensor in state.items()}
    reload_weights(app, (99, ray.put(zeroed)), model_config=model)
    status, reply = call(f"{app.url}/generate", {"prompt": "abc", "max_new_tokens": 3, "temperature": 0})
    assert status == 200 and reply["step"] == 99


def test_lora_adapters_are_models_of_their_own_and_generate_peft_greedy_tokens(trained, tmp_path):
    """serve(adapters=...): an adapter directory as peft saves it is listed as a model whose parent is the served
    one, and requests naming it (alone or as '<model>:<adapter>') generate peft + transformers' greedy tokens,
    while requests naming the model are unchanged."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, result = trained
    torch.manual_seed(3)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(result.checkpoint_path),
                                LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], lora_dropout=0.0))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    peft_model.save_pretrained(tmp_path / "tuned")
    info = serve(result.checkpoint_path, name="tiny-lora", port=free_port(), adapters={"tuned": tmp_path / "tuned"})
    try:
        status, listed = call(f"{info.url}/v1/models")
        assert status == 200 and [(m["id"], m["parent"]) for m in listed["data"]] == [("tiny-lora", None),
                                                                                        ("tuned", "tiny-lora")]
        prompt = [5, 17, 33, 2]
        tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(result.checkpoint_path),
                                          tmp_path / "tuned").eval()
        expected = tuned.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, 4:]
        text = AutoTokenizer.from_pretrained(result.checkpoint_path).decode(expected, skip_special_tokens=True)
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        answers = {name: call(f"{info.url}/v1/completions", {**body, "model": name})[1]
                   for name in ("tuned", "tiny-lora:tuned", "tiny-lora")}
        assert answers["tuned"]["choices"][0]["text"] == answers["tiny-lora:tuned"]["choices"][0]["text"] == text
        assert answers["tuned"]["model"] == "tuned" and answers["tiny-lora"]["choices"][0]["text"] != text
        assert call(f"{info.url}/v1/completions", {**body, "model": "other"})[0] == 404
    finally:
        shutdown(info)
