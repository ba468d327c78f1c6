"""serve(): the reference GPT behind Ray Serve, from an in-memory state and from a checkpoint.

One Serve instance for the whole module (starting Serve costs seconds). Its application answers
generate and health, refuses malformed requests with 4xx and a reason, swaps weights in place, and
answers 503 rather than failing when more requests arrive than its queues hold. A second,
disaggregated application (prefill and decode replicas) answers with the first one's greedy tokens.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
import torch

from baige_ray.bench.colocate_load import replay, saturated_throughput
from baige_ray.checkpoint.final import save_model_checkpoint
from baige_ray.models.gpt import GPT, GPTConfig
from baige_ray.models.gpt_decoding import decode_tokens, generate_batch
from baige_ray.models.hf.tiny import make_llama_tiny
from baige_ray.runtime.checkpoint_io import load_model
from baige_ray.serving import KVCacheConfig, rebalance, reload_weights, scale_replicas, serve, shutdown, side_loads
from baige_ray.serving.app import prefix_cache_stats
from baige_ray.serving.causal_lm_generation import SamplingParams
from baige_ray.serving.disaggregation import PREFILL_DEPLOYMENT, DisaggregationOptions
from baige_ray.serving.expert_parallel import ExpertParallelServing
from baige_ray.serving.proxy_memory import return_proxy_memory, serve_proxies
from baige_ray.serving.requests import GenerateRequest

from ..moe_helpers import HOT_EXPERT, PROMPTS, greedy_tokens, skewed_moe_gpt
from tests.helpers import free_port

CONFIG = GPTConfig(seq_len=32, num_layers=1, num_heads=2, hidden=32)


def call(url: str, body: bytes | dict | None = None, method: str | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method or ("POST" if data is not None else "GET"))
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        text = error.read()
        return error.code, json.loads(text) if text.startswith(b"{") else {"raw": text.decode()}


def stream(url: str, body: dict) -> list[dict]:
    """The server-sent events' JSON payloads, up to [DONE]."""
    request = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=60) as response:
        lines = response.read().decode().splitlines()
    payloads = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    return [json.loads(payload) for payload in payloads[:-1]]


def initial_state() -> dict:
    torch.manual_seed(0)
    return GPT(CONFIG).state_dict()


@pytest.fixture(scope="module")
def app(local_ray):
    info = serve((3, ray.put(initial_state())), model_config=CONFIG, name="test-gpt", port=free_port(),
                 max_ongoing_requests=2, max_queued_requests=2, max_batch_size=4)
    yield info
    shutdown(info)


def test_generate_and_health_from_an_in_memory_state(app):
    assert app.url.startswith("http://127.0.0.1:")
    status, health = call(app.url + "/health")
    assert (status, health["status"], health["step"]) == (200, "ok", 3)
    status, reply = call(app.url + "/generate", {"prompt": "def ", "max_new_tokens": 6, "seed": 7})
    assert status == 200 and reply["tokens"] == 6 and reply["latency_s"] > 0
    assert call(app.url + "/generate", {"prompt": "def ", "max_new_tokens": 6, "seed": 7})[1]["text"] == reply["text"]


@pytest.mark.parametrize(
    ("body", "method", "route", "status", "words"),
    [
        (b"{not json", None, "/generate", 400, "not valid JSON"),
        ({"prompt": ""}, None, "/generate", 400, "must not be empty"),
        ({"prompt": "x", "max_new_tokens": 10_000}, None, "/generate", 400, "out of range"),
        ({"prompt": "x", "temperature": "warm"}, None, "/generate", 400, "must be a number"),
        ({"prompt": "x", "seed": -1}, None, "/generate", 400, "'seed'"),
        ({"prompt": "x" * 30, "max_new_tokens": 3}, None, "/generate", 400, "30 in the prompt and max_new_tokens=3"),
        (None, "GET", "/generate", 405, "use POST"),
        (None, "GET", "/nowhere", 404, "no route"),
    ],
)
def test_malformed_requests_get_4xx_with_a_reason(app, body, method, route, status, words):
    code, reply = call(app.url + route, body, method)
    assert code == status
    assert words in reply["error"]


def test_weights_swap_in_place_from_a_checkpoint(app, tmp_path):
    torch.manual_seed(1)
    save_model_checkpoint(tmp_path / "ckpt", GPT(CONFIG).state_dict(), model_config=CONFIG, step=11)
    reload_weights(app, tmp_path / "ckpt")
    assert call(app.url + "/health")[1]["step"] == 11
    status, reply = call(app.url + "/generate", {"prompt": "import", "max_new_tokens": 5, "temperature": 0})
    expected = generate_batch(load_model(tmp_path / "ckpt"), [GenerateRequest(prompt="import", max_new_tokens=5,
                                                                               temperature=0.0)])[0]
    assert (status, reply["text"], reply["step"]) == (200, decode_tokens(expected), 11)


def test_overload_is_answered_503_not_failed(app):
    body = {"prompt": "x" * 30, "max_new_tokens": 31, "temperature": 1.0, "truncate_prompt_tokens": 1}  # fills 32
    with ThreadPoolExecutor(max_workers=12) as pool:
        codes = list(pool.map(lambda _: call(app.url + "/generate", body)[0], range(12)))
    assert set(codes) <= {200, 503}
    assert codes.count(200) >= 2 and codes.count(503) >= 1
    assert call(app.url + "/health")[0] == 200


def test_the_proxy_gives_a_drained_backlog_back_without_importing_torch(app):
    body = {"prompt": "x" * 30, "max_new_tokens": 31, "truncate_prompt_tokens": 1}
    with ThreadPoolExecutor(max_workers=48) as pool:
        assert set(pool.map(lambda _: call(app.url + "/generate", body)[0], range(96))) <= {200, 503}
    (proxy,) = return_proxy_memory()
    assert 0 <= proxy.returned < proxy.resident_before
    (proxy_handle,) = serve_proxies().values()
    modules = ray.get(proxy_handle.__ray_call__.remote(lambda _: [m for m in __import__("sys").modules
                                                                  if m.split(".")[0] in ("torch", "baige_ray")]))
    assert modules == []  # the trim ran by value: importing it would have cost the proxy 170 MiB


def test_serves_throughput_settings_reach_serves_processes_and_not_the_callers(app):
    """The proxy streams over gRPC and runs its handles' routers on its own loop; the driver keeps Serve's
    defaults, where a handle may be used under asyncio.run more than once (serving/serve_throughput.py)."""
    from ray.util.state import list_actors

    from baige_ray.serving.serve_throughput import SERVE_THROUGHPUT_ENV

    (proxy_handle,) = serve_proxies().values()
    proxy_env = ray.get(proxy_handle.__ray_call__.remote(
        lambda _, names: {name: __import__("os").environ.get(name) for name in names}, list(SERVE_THROUGHPUT_ENV)))
    assert proxy_env == SERVE_THROUGHPUT_ENV
    (replica,) = [actor for actor in list_actors(filters=[("state", "=", "ALIVE")])
                  if actor.class_name == "ServeReplica:test-gpt:ModelServer"]
    replica_env = open(f"/proc/{replica.pid}/environ", "rb").read().split(b"\0")
    assert b"RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0" in replica_env
    assert all(name not in __import__("os").environ for name in SERVE_THROUGHPUT_ENV)


class TestTwoReplicas:
    """Two replicas of a tiny Llama on the same Serve instance, each also answering on a port of its own; they
    hold two of the four devices while this class's tests run, and give them back before the next test."""

    @pytest.fixture(scope="class")
    def two_replicas(self, app, tmp_path_factory):
        model, _ = make_llama_tiny(tmp_path_factory.mktemp("llama-burst"), seq_len=64, vocab_size=512,
                                   name="llama-burst", shape=dict(hidden_size=64, intermediate_size=128,
                                                                  num_hidden_layers=2, num_attention_heads=4,
                                                                  num_key_value_heads=2))
        info = serve(model.path, model_config=model, name="test-burst", route_prefix="/burst", num_replicas=2,
                     max_queued_requests=4096, direct_ingress=True)
        yield info
        shutdown(info)

    def test_a_backlog_drains_at_what_the_replicas_answer(self, two_replicas):
        """Found by `bench soak --seed 3`: under Serve's own router backoff (0.5 s per routing task), two idle
        replicas answered 8 requests/s after a burst, against 96-122 saturated (serving/request_routing.py)."""
        url = two_replicas.url + "/generate"
        capacity = saturated_throughput(url, seconds=3.0)
        spike = 1.5 * capacity  # half again what they answer arrives for 4 s: a backlog builds at the proxy
        arrivals = [index / spike for index in range(int(4 * spike))]
        answers = replay(url, arrivals, timeout_s=60.0)
        assert [a.status for a in answers if a.status != 200] == []
        drained = sorted(a.finished_at for a in answers if a.finished_at > arrivals[-1])
        assert len(drained) / (drained[-1] - arrivals[-1]) > 0.5 * capacity

    def test_a_seeded_request_gets_the_same_sample_from_each_replica(self, two_replicas):
        """Each replica at its own port (direct_ingress): the same seed draws the same tokens on either replica,
        and on either one again; another seed draws others."""
        first, second = two_replicas.replica_urls
        assert {first, second} != {two_replicas.url} and first.endswith("/burst")
        body = {"prompt": "def ", "max_tokens": 12, "temperature": 1.0, "seed": 7, "n": 2, "model": "test-burst"}
        answers = [call(url + "/v1/completions", body) for url in (first, second, first)]
        assert [status for status, _ in answers] == [200, 200, 200]
        texts = [[choice["text"] for choice in reply["choices"]] for _, reply in answers]
        assert texts[0] == texts[1] == texts[2] and texts[0][0] != texts[0][1]  # n=2: seeds 7 and 8
        status, other = call(second + "/v1/completions", {**body, "seed": 8, "n": 1})
        assert status == 200 and other["choices"][0]["text"] == texts[0][1]


@pytest.fixture(scope="module")
def disaggregated_app(app):
    """Beside `app` on the same Serve instance: one prefill and one decode replica, each with a prefix cache."""
    info = serve((3, ray.put(initial_state())), model_config=CONFIG, name="test-gpt-pd", route_prefix="/pd",
                 max_batch_size=4, disaggregation=DisaggregationOptions(prefill_replicas=1, decode_replicas=1),
                 kv_cache=KVCacheConfig(block_tokens=4))
    yield info
    shutdown(info)


def test_a_disaggregated_app_answers_with_the_colocated_greedy_tokens(app, disaggregated_app):
    reload_weights(app, (3, ray.put(initial_state())), model_config=CONFIG)  # an earlier test may have swapped them
    assert disaggregated_app.url.startswith("http://127.0.0.1:") and disaggregated_app.url.endswith("/pd")
    for prompt, max_tokens in (("def f(x):\n    return", 12), ("x", 20), ("import os, sys\nfrom pathlib import", 6)):
        # The last prompt (34 bytes) keeps its last 26: with 6 new tokens, the context of 32.
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "truncate_prompt_tokens": 26}
        code, colocated = call(app.url + "/v1/completions", {**body, "model": "test-gpt"})
        status, split = call(disaggregated_app.url + "/v1/completions", {**body, "model": "test-gpt-pd"})
        assert (code, status) == (200, 200)
        assert split["choices"][0]["text"] == colocated["choices"][0]["text"]
        assert split["usage"] == colocated["usage"] and split["usage"]["completion_tokens"] == max_tokens
    chunks = stream(disaggregated_app.url + "/v1/completions", {**body, "model": "test-gpt-pd"})
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == split["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # The same prompt again: both sides run it from their prefix blocks, with the same answer.
    assert call(disaggregated_app.url + "/v1/completions", {**body, "model": "test-gpt-pd"})[1]["choices"] == \
        split["choices"]
    time.sleep(1.2)  # the replicas' next reports carry their counts
    assert all(sum(report["hits"].values()) > 0 for report in prefix_cache_stats(disaggregated_app).values())


def test_prefill_replicas_hand_the_prompt_cache_over_through_ray(disaggregated_app):
    from ray import serve as ray_serve

    handle = ray_serve.get_deployment_handle(PREFILL_DEPLOYMENT, app_name=disaggregated_app.app_name)
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    prefilled = handle.prefill.remote(list(b"import os"), params).result(timeout_s=60)
    assert (prefilled.prompt_length, prefilled.budget, prefilled.finish_reason) == (9, 8, None)
    assert len(prefilled.kv) == CONFIG.num_layers and prefilled.kv[0][0].shape[2] == 9
    assert prefilled.weights_version >= 1
    # A decode replica holding the first 8 tokens' blocks is sent the last token's keys and values only.
    rest = handle.prefill.remote(list(b"import os"), params, 8).result(timeout_s=60)
    assert (rest.kv_from, rest.kv[0][0].shape[2], rest.first_token) == (8, 1, prefilled.first_token)


def _wait_until_both_sides_report_idle(info, timeout_s: float = 10.0) -> None:
    """Replicas report about once a second: a request an earlier test sent can still be in the last report."""
    deadline = time.monotonic() + timeout_s
    while any(load.num_requests for load in side_loads(info).values()):
        assert time.monotonic() < deadline, f"the sides still report queued requests: {side_loads(info)}"
        time.sleep(0.2)


def test_the_sides_resize_by_the_split_policy_as_the_arbiter_asks(disaggregated_app):
    """What the pool arbiter does on a lend and a reclaim: idle sides, so a tie, which goes to decode."""
    _wait_until_both_sides_report_idle(disaggregated_app)
    lent = rebalance(disaggregated_app, num_replicas=3)
    assert (lent.prefill_replicas, lent.decode_replicas) == (1, 2)
    loads = side_loads(disaggregated_app)
    assert (loads["prefill"].num_replicas, loads["decode"].num_replicas) == (1, 2)
    assert call(disaggregated_app.url + "/generate", {"prompt": "def ", "max_new_tokens": 4})[0] == 200
    reclaimed = rebalance(disaggregated_app, num_replicas=2)
    assert (reclaimed.prefill_replicas, reclaimed.decode_replicas) == (1, 1)
    assert rebalance(disaggregated_app) is None  # balanced: nothing moves
    with pytest.raises(ValueError, match="disaggregated"):
        scale_replicas(disaggregated_app, 2)


@pytest.fixture(scope="module")
def expert_parallel_app(app):
    """Beside `app`: a mixture-of-experts GPT whose replica spreads its experts over 3 processes."""
    config, model = skewed_moe_gpt()
    info = serve((0, ray.put(model.state_dict())), model_config=config, name="test-moe-ep", route_prefix="/ep",
                 max_batch_size=4, ray_actor_options={"num_cpus": 0.25},
                 expert_parallel=ExpertParallelServing(ranks=3, slots_per_rank=2, rebalance_every=16))
    yield info, config, model
    shutdown(info)


def _greedy_texts(url: str) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        status, reply = call(url + "/generate", {"prompt": prompt, "max_new_tokens": 12, "temperature": 0})
        assert status == 200, reply
        texts.append(reply["text"])
    return texts


def test_an_expert_parallel_replica_answers_one_process_tokens_and_copies_the_hot_expert(expert_parallel_app):
    info, config, model = expert_parallel_app
    expected = [decode_tokens(tokens) for tokens in greedy_tokens(model)]
    assert _greedy_texts(info.url) == expected
    assert _greedy_texts(info.url) == expected  # again, after re-placements from the first pass's load
    experts = call(info.url + "/health")[1]["experts"]
    assert experts["placements_made"] >= 3  # the first placement and re-placements every 16 forwards
    assert all(slots.count(HOT_EXPERT) >= 2 for slots in experts["slots"])
    assert len(experts["rank_rows"]) == 3


def test_an_expert_parallel_replica_takes_new_weights_in_place(expert_parallel_app):
    info, config, _ = expert_parallel_app
    _, other = skewed_moe_gpt(seed=1)
    reload_weights(info, (1, ray.put(other.state_dict())), model_config=config)
    assert call(info.url + "/health")[1]["step"] == 1
    assert _greedy_texts(info.url) == [decode_tokens(tokens) for tokens in greedy_tokens(other)]


def test_expert_parallel_serving_refuses_a_dense_model_and_impossible_slots(app):
    with pytest.raises(ValueError, match="has no experts"):
        serve((0, ray.put(initial_state())), model_config=CONFIG, name="dense-ep",
              expert_parallel=ExpertParallelServing(ranks=2))
    config, model = skewed_moe_gpt()
    with pytest.raises(ValueError, match="ExpertParallelServing.slots_per_rank=1 is invalid for 4 experts over 3"):
        serve((0, ray.put(model.state_dict())), model_config=config, name="few-slots",
              expert_parallel=ExpertParallelServing(ranks=3, slots_per_rank=1))
    with pytest.raises(ValueError, match="ServeOptions.expert_parallel is set with engine='vllm'"):
        serve((0, ray.put(model.state_dict())), model_config=config, name="ep-vllm", engine="vllm",
              expert_parallel=ExpertParallelServing())
