"""Fuzz the HTTP surface while a steady load runs: malformed, oversized and adversarial requests and
clients that vanish mid-request. No answer may be a 5xx, no well-formed request may fail, and the
replica must stay up (one replica: a crash would fail the steady load and the final health check)."""

from __future__ import annotations

import http.client
import json
import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import pytest
import ray
import torch

from baige_ray.models.gpt import GPT, GPTConfig
from baige_ray.serving import serve, shutdown
from tests.cluster.test_colocate_cluster import SteadyLoad as ColocateSteadyLoad
from tests.helpers import free_port

CONFIG = GPTConfig(seq_len=32, num_layers=1, num_heads=2, hidden=32)
ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")
FIELDS = ("prompt", "max_tokens", "max_new_tokens", "max_completion_tokens", "temperature", "seed", "stream",
          "stop", "n", "top_p", "model", "messages", "stream_options", "logprobs", "echo", "user", "zzz")
VALUES = (None, True, False, 0, -1, 1.5, 10**30, -(10**30), 1e308, float("nan"), float("inf"), "", "x", "💥" * 50,
          [], [1, 2], ["a"], {}, {"a": 1}, [{"role": "user", "content": "hi"}], [{"role": 3}], 10**9, 512)


@pytest.fixture(scope="module")
def app(local_ray):
    torch.manual_seed(0)
    info = serve((1, ray.put(GPT(CONFIG).state_dict())), model_config=CONFIG, name="fuzz", port=free_port())
    yield info
    shutdown(info)


def json_case(rng: random.Random) -> bytes:
    payload = {rng.choice(FIELDS): rng.choice(VALUES) for _ in range(rng.randint(0, 5))}
    if rng.random() < 0.5:
        payload.setdefault("prompt", rng.choice(["def ", "", 7, None, "x" * 20_000]))
    return json.dumps(payload).encode()


def malformed_bodies(rng: random.Random) -> list[tuple[str, str, bytes | None]]:
    cases: list[tuple[str, str, bytes | None]] = []
    for _ in range(380):
        cases.append(("POST", rng.choice(ROUTES), json_case(rng)))
    for _ in range(40):
        body = json.dumps({"prompt": "def ", "max_tokens": 4})
        cases.append(("POST", rng.choice(ROUTES), body[: rng.randint(0, len(body) - 1)].encode()))  # truncated
    for _ in range(30):
        cases.append(("POST", rng.choice(ROUTES), bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))))
    for _ in range(15):
        cases.append(("POST", rng.choice(ROUTES), b'{"prompt": "\xff\xfe caf\xe9"}'))  # not UTF-8
    for _ in range(5):
        cases.append(("POST", rng.choice(ROUTES), b"[" * 200_000 + b"]" * 200_000))  # nesting
    for _ in range(3):
        cases.append(("POST", rng.choice(ROUTES), b'{"prompt": "' + b"x" * (10 * 1024 * 1024) + b'"}'))  # 10 MB
    for _ in range(15):
        cases.append((rng.choice(["GET", "PUT", "DELETE"]), rng.choice(ROUTES + ("/nowhere", "/v1/models")), None))
    return cases


def send(base: str, method: str, route: str, body: bytes | None) -> int:
    parts = urlsplit(base)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    try:
        connection.request(method, parts.path + route, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        response.read()
        return response.status
    except (ConnectionError, http.client.RemoteDisconnected):
        return 0  # the server closed the connection on an oversized body: not an error answer
    finally:
        connection.close()


def vanish_mid_stream(base: str, rng: random.Random) -> None:
    """Start a streamed completion, read a little, and drop the connection."""
    parts = urlsplit(base)
    body = json.dumps({"prompt": "def ", "max_tokens": 30, "stream": True, "temperature": 1.0}).encode()
    with socket.create_connection((parts.hostname, parts.port), timeout=60) as raw:
        raw.sendall(f"POST {parts.path}/v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        raw.recv(rng.randint(1, 400))


def vanish_mid_body(base: str) -> None:
    parts = urlsplit(base)
    with socket.create_connection((parts.hostname, parts.port), timeout=60) as raw:
        raw.sendall(f"POST {parts.path}/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n".encode() + b'{"pro')


class SteadyLoad(ColocateSteadyLoad):
    """Well-formed requests, whole and streamed, one every 50 ms on a thread; keeps every status."""

    BODIES = (("/generate", {"prompt": "def ", "max_new_tokens": 4}),
              ("/v1/completions", {"prompt": "import", "max_tokens": 4, "stream": True}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}))

    def __init__(self, base: str):
        super().__init__(base, interval_s=0.05)

    def _one(self, index: int) -> int:
        route, body = self.BODIES[index % len(self.BODIES)]
        return send(self.url, "POST", route, json.dumps(body).encode())


def test_fuzzed_requests_get_4xx_never_5xx_and_the_replica_stays_up(app):
    rng = random.Random(0)
    cases = malformed_bodies(rng)
    started = time.monotonic()
    with SteadyLoad(app.url) as load, ThreadPoolExecutor(max_workers=4) as pool:
        statuses = list(pool.map(lambda case: send(app.url, *case), cases))
        for _ in range(25):
            vanish_mid_stream(app.url, rng)
        for _ in range(10):
            vanish_mid_body(app.url)
        time.sleep(1.0)
    elapsed = time.monotonic() - started
    answered = [status for status in statuses if status]
    print(f"{len(cases) + 35} adversarial requests in {elapsed:.1f}s beside {len(load.statuses)} well-formed ones; "
          f"statuses {sorted(set(statuses))}")
    assert len(cases) + 35 >= 500
    assert not [status for status in answered if status >= 500], sorted(set(statuses))
    assert sum(400 <= status < 500 for status in answered) >= 450
    assert load.statuses and set(load.statuses) == {200}, f"well-formed requests failed: {load.statuses}"
    assert send(app.url, "GET", "/health", None) == 200
