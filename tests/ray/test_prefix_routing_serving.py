"""Cache-aware routing over two replicas (`serve(..., routing="prefix")`), through the official `openai` client.

Requests sharing a system prompt and the turns of a chat go to the replica that holds their prefix,
so the other replica never looks those blocks up; answers are transformers' greedy tokens, whole or
streamed, and malformed requests still get their 4xx through the ingress. A replica scaled away hands
its hot blocks to the one left, which then finds every prompt either of them had seen.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from baige_ray.serving import KVCacheConfig, scale_replicas, serve, shutdown
from baige_ray.serving.app import prefix_cache_stats, serving_events
from tests.hf_helpers import build_tiny_hf
from tests.helpers import free_port
from tests.ray.test_serving import call

pytestmark = pytest.mark.ray

SYSTEM = "You are a terse assistant for Python code. "
# Eight requests: under Serve's default routing all eight land on one of two replicas 1 time in 128.
QUESTIONS = ["def parse(", "import os", "class Node:", "for i in", "while True:", "return x", "with open(", "try:"]


@pytest.fixture(scope="module")
def tiny(local_ray, tmp_path_factory):
    return build_tiny_hf(tmp_path_factory.mktemp("prefix-routing"))


@pytest.fixture(scope="module")
def app(tiny):
    info = serve(str(tiny.model_dir), name="prefix-routed", port=free_port(), num_replicas=2, routing="prefix",
                 kv_cache=KVCacheConfig(block_tokens=4))
    yield info
    shutdown(info)


@pytest.fixture(scope="module")
def client(app):
    from openai import OpenAI

    return OpenAI(base_url=f"{app.url}/v1", api_key="unused", max_retries=0, timeout=60)


def greedy(model_dir, prompt: str, max_new_tokens: int) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    # As a server sends it: a character still unfinished when generation stops is dropped (vLLM's rule, and ours).
    return tokenizer.decode(out[0, ids.shape[1]:]).rstrip("\ufffd")


def reported(app) -> dict[str, dict]:
    """Each replica's prefix cache counts, once every replica has reported since the last request."""
    time.sleep(1.2)  # replicas report every 0.5 s
    return prefix_cache_stats(app)


def lookups(app) -> dict[str, int]:
    """Blocks each replica looked for (found in any tier or not)."""
    return {replica: sum(report["hits"].values()) + report["misses"] for replica, report in reported(app).items()}


def test_requests_sharing_a_prefix_go_to_the_replica_holding_it_with_transformers_tokens(app, client, tiny):
    before = lookups(app)
    texts = {}
    for question in QUESTIONS:
        reply = client.completions.create(model="prefix-routed", prompt=SYSTEM + question, max_tokens=6, temperature=0)
        texts[question] = reply.choices[0].text
    after = lookups(app)
    grew = sorted(replica for replica in after if after[replica] > before.get(replica, 0))
    assert len(grew) == 1, (before, after)  # one replica looked every prompt up: the other never saw them
    assert texts[QUESTIONS[-1]] == greedy(tiny.model_dir, SYSTEM + QUESTIONS[-1], 6)
    streamed = client.completions.create(model="prefix-routed", prompt=SYSTEM + QUESTIONS[0], max_tokens=6,
                                         temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == texts[QUESTIONS[0]]


def test_chat_turns_follow_their_history_and_bad_requests_get_their_4xx(app, client):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "def f("}]
    before = lookups(app)
    for _ in range(3):
        reply = client.chat.completions.create(model="prefix-routed", messages=messages, max_tokens=4, temperature=0)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "and then?"}]
    after = lookups(app)
    assert sum(after[r] > before.get(r, 0) for r in after) == 1, (before, after)
    assert call(f"{app.url}/v1/completions", b"{not json")[0] == 400
    assert call(f"{app.url}/v1/completions", {"prompt": "x", "model": "another"})[0] == 404
    assert call(f"{app.url}/nowhere")[0] == 404
    status, health = call(f"{app.url}/health")
    assert status == 200 and "prefix_cache" in health


def test_a_replica_scaled_away_hands_its_blocks_to_the_one_left(app, client):
    prompts = [f"Topic {n}: " + "the standard library module " * 3 + str(n) for n in range(6)]

    def ask(prompt: str) -> str:
        reply = client.completions.create(model="prefix-routed", prompt=prompt, max_tokens=4, temperature=0)
        return reply.choices[0].text

    with ThreadPoolExecutor(len(prompts)) as pool:  # at once: least loaded first spreads them over both
        answers = list(pool.map(ask, prompts))
    stored = {replica: report["stored"] for replica, report in reported(app).items()}
    assert len(stored) == 2 and all(stored.values()), stored
    scale_replicas(app, 1)
    handed = [event for event in serving_events(app, 50) if event["kind"] == "kv_handover"]
    assert len(handed) == 1 and handed[0]["blocks"] > 0 and handed[0]["kept"] == handed[0]["blocks"], handed
    (left,) = set(stored) - {handed[0]["replica"]}
    before = reported(app)[left]
    assert [ask(prompt) for prompt in prompts] == answers
    after = reported(app)[left]
    assert after["hits"]["device"] > before["hits"]["device"] and after["misses"] == before["misses"], (before, after)
