"""A trained Hugging Face model leaves as a directory `transformers` loads, and is served over HTTP.

The tiny Llama trains as an elastic job; its final checkpoint is a Hugging Face directory whose
logits equal the trained state's, and `serve()` hosts it (with its tokenizer, a KV cache and
continuous batching) behind the OpenAI-compatible routes, whole and streamed, beside /generate.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest
import ray
import torch

from baige_ray.api.elastic import ElasticConfig
from baige_ray.models.plugin import plugin_for
from baige_ray.serving import reload_weights, serve, shutdown
from baige_ray.serving.generators import text_generator
from baige_ray.serving.requests import GenerateRequest
from tests.helpers import free_port
from tests.hf_helpers import build_tiny_hf, elastic_hf_run, peft_greedy_text, save_job_adapter, save_random_adapter
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


def test_lora_adapters_from_a_directory_and_from_a_running_jobs_memory_generate_peft_greedy_tokens(trained, tmp_path):
    """serve(adapters=...): an adapter directory as peft saves it, and the adapter a running LoRA job holds in
    memory (no file written), are models of their own whose parent is the served one; requests naming one
    (alone or as '<model>:<adapter>') generate peft + transformers' greedy tokens with it, and requests naming
    the model are unchanged. Three steps later, reload_adapter puts the job's newer adapter in every replica
    in place, and requests generate with it."""
    from peft import LoraConfig
    from transformers import AutoTokenizer

    from baige_ray.api.configs import RunConfig, ScalingConfig, TrainConfig
    from baige_ray.jobs.launch import launch
    from baige_ray.models.hf import HFModel
    from baige_ray.serving import reload_adapter

    model, result = trained
    save_random_adapter(result.checkpoint_path, tmp_path / "tuned")
    adapter = LoraConfig(r=4, lora_alpha=16, target_modules=["v_proj", "up_proj"], lora_dropout=0.0)
    live = launch(HFModel(result.checkpoint_path, seq_len=model.seq_len), adapter=adapter, steps_allowed=3,
                  data=_training_data(trained),
                  train=TrainConfig(num_steps=9, global_batch_size=4, learning_rate=5e-2, warmup_steps=0),
                  scaling=ScalingConfig(num_workers=1, placement_timeout_s=120),
                  run=RunConfig(name="hf-export-lora", storage_path=tmp_path, show_progress=False))
    info = None
    try:
        step = live.wait_for_snapshot(3, timeout_s=120)[0]
        info = serve(result.checkpoint_path, name="tiny-lora", port=free_port(), route_prefix="/lora",
                     adapters={"tuned": tmp_path / "tuned", "live": live})
        save_job_adapter(live, adapter, tmp_path / "live", result.checkpoint_path)
        status, listed = call(f"{info.url}/v1/models")
        assert status == 200 and [(m["id"], m["parent"]) for m in listed["data"]] == [
            ("tiny-lora", None), ("tuned", "tiny-lora"), ("live", "tiny-lora")]
        assert listed["data"][2]["root"] == f"memory: training step {step}"
        prompt, tokenizer = [5, 17, 33, 2], AutoTokenizer.from_pretrained(result.checkpoint_path)
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        for name in ("tuned", "live"):
            text = peft_greedy_text(result.checkpoint_path, tmp_path / name, prompt, tokenizer)
            for model_id in (name, f"tiny-lora:{name}"):
                status, answer = call(f"{info.url}/v1/completions", {**body, "model": model_id})
                assert status == 200 and answer["choices"][0]["text"] == text and answer["model"] == name, model_id
        plain = call(f"{info.url}/v1/completions", {**body, "model": "tiny-lora"})[1]["choices"][0]["text"]
        assert plain != text
        assert call(f"{info.url}/v1/completions", {**body, "model": "other"})[0] == 404

        live.allow_steps(6)
        newer = live.wait_for_snapshot(6, timeout_s=120)[0]
        began = time.perf_counter()
        reload_adapter(info, "live", live)
        print(f"adapter of step {newer} serving {time.perf_counter() - began:.3f}s after reload_adapter")
        save_job_adapter(live, adapter, tmp_path / "live-newer", result.checkpoint_path)
        live.kill()  # what replicas serve is a copy of the driver's, not the job's snapshot
        newer_text = peft_greedy_text(result.checkpoint_path, tmp_path / "live-newer", prompt, tokenizer)
        assert newer_text != text
        status, answer = call(f"{info.url}/v1/completions", {**body, "model": "live"})
        assert status == 200 and answer["choices"][0]["text"] == newer_text
        assert call(f"{info.url}/v1/models")[1]["data"][2]["root"] == f"memory: training step {newer}"
        with pytest.raises(ValueError, match="not served by this application"):
            reload_adapter(info, "unknown", tmp_path / "tuned")
    finally:
        live.kill()
        if info is not None:
            shutdown(info)


def _training_data(trained):
    """The dataset the fixture's job trained on (elastic_hf_run's: the tiny model's TokenDataset)."""
    from baige_ray.models.token_dataset import TokenDataset

    model, _ = trained
    return TokenDataset.open(Path(model.path).parent / "data")
