"""Cache-aware routing over 2 replicas against Serve's default routing and against one replica.

The same text workload, generated here, goes through `serve()` three times, each a fresh application
whose replicas run the built-in engine with a prefix cache: one replica (its hit rate is the most any
routing over several replicas can reach), two replicas behind Serve's default routing (power of two
choices), and two replicas with `routing="prefix"`. Requests are OpenAI completions sent by the
official `openai` client, streamed (TTFT is the first chunk's arrival), `concurrency` clients each in
a closed loop: requests over a few shared system prompts, and chats whose every turn is the whole
history so far plus a new message. The hit rate is the share of prompt blocks the replicas looked up
that some tier held, from their own counts (GET /health's `prefix_cache`, reported to the registry).
"""

from __future__ import annotations

import argparse
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

RUNS = {"single": (1, "default"), "default": (2, "default"), "prefix": (2, "prefix")}


@dataclass(frozen=True)
class TextSession:
    """One client's conversation: a system prompt, then user messages, one request each."""

    system: str
    messages: tuple[str, ...]


def text_workload(corpus: str, *, seed: int, systems: int, shared_requests: int, chats: int, turns: int,
                  system_chars: int, user_chars: int) -> list[TextSession]:
    """Requests over `systems` shared system prompts, visited in turn, interleaved with `chats` chats of
    `turns` turns, each with a system prompt of its own; all text is slices of `corpus`."""
    rng = np.random.default_rng(seed)

    def text(n: int) -> str:
        start = int(rng.integers(0, len(corpus) - n))
        return corpus[start:start + n]

    prompts = [text(system_chars) for _ in range(systems)]
    shared = [TextSession(prompts[i % systems], (text(user_chars),)) for i in range(shared_requests)]
    talks = [TextSession(text(system_chars), tuple(text(user_chars) for _ in range(turns))) for _ in range(chats)]
    mixed = []
    for index in range(max(len(shared), len(talks))):
        mixed += shared[index:index + 1] + talks[index:index + 1]
    return mixed


def _replay(url: str, app: str, sessions: list[TextSession], *, concurrency: int, answer_tokens: int) -> list[float]:
    """Every session's turns through the app, `concurrency` clients at a time; the TTFT of each request."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    queue, ttfts, lock = list(sessions), [], threading.Lock()

    def converse() -> None:
        while True:
            with lock:
                if not queue:
                    return
                session = queue.pop(0)
            prompt = session.system
            for message in session.messages:
                prompt += message
                started, pieces = time.perf_counter(), []
                for chunk in client.completions.create(model=app, prompt=prompt, max_tokens=answer_tokens,
                                                       temperature=0, stream=True):
                    if not pieces:
                        with lock:
                            ttfts.append(time.perf_counter() - started)
                    pieces.append(chunk.choices[0].text)
                prompt += "".join(pieces)

    threads = [threading.Thread(target=converse) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return ttfts


def _hit_rate(stats: dict[str, dict]) -> tuple[float, int, int]:
    hits = sum(sum(report["hits"].values()) for report in stats.values())
    looked = hits + sum(report["misses"] for report in stats.values())
    return (hits / looked if looked else 0.0), hits, looked


def measure(model_dir: Path, sessions: list[TextSession], *, concurrency: int, answer_tokens: int,
            block_tokens: int) -> dict[str, Any]:
    """The three runs, each on a fresh application; needs a connected Ray."""
    from ray import serve as ray_serve

    from baige_ray.serving import KVCacheConfig, serve, shutdown
    from baige_ray.serving.app import prefix_cache_stats

    results = {}
    for name, (replicas, routing) in RUNS.items():
        app = f"prefix-{name}"
        info = serve(str(model_dir), name=app, num_replicas=replicas, routing=routing,
                     kv_cache=KVCacheConfig(block_tokens=block_tokens))
        started = time.perf_counter()
        ttfts = _replay(info.url, app, sessions, concurrency=concurrency, answer_tokens=answer_tokens)
        seconds = time.perf_counter() - started
        time.sleep(1.2)  # the replicas' next reports carry their last counts
        rate, hits, looked = _hit_rate(prefix_cache_stats(info))
        shutdown(info)
        results[name] = {"replicas": replicas, "routing": routing, "hit_rate": rate, "hits": hits,
                         "blocks_looked_up": looked, "requests": len(ttfts), "seconds": seconds,
                         "ttft_p50_s": float(np.percentile(ttfts, 50)), "ttft_p99_s": float(np.percentile(ttfts, 99))}
    ray_serve.shutdown()
    single = results["single"]["hit_rate"]
    return {"routing_hit_rate_vs_single": results["prefix"]["hit_rate"] / single if single else None,
            "default_hit_rate_vs_single": results["default"]["hit_rate"] / single if single else None,
            "runs": results}


def run_routing(args: argparse.Namespace, model_shape: dict, work: Path) -> dict[str, Any]:
    """Make a model of `model_shape` with a tokenizer trained here, then `measure` on a local Ray."""
    from baige_ray.bench.measure import bench_ray
    from baige_ray.models.hf.tiny import make_llama_tiny

    corpus_dir = work / "routing"
    shape = {key: value for key, value in model_shape.items() if key != "vocab_size"}  # the tokenizer's
    model, _ = make_llama_tiny(corpus_dir, shape=shape, vocab_size=model_shape["vocab_size"], name="prefix-model",
                               text_bytes=256 * 1024)
    corpus = "".join(path.read_text() for path in sorted((corpus_dir / "text").iterdir()))
    quick = args.quick
    # About 4 characters a token in this tokenizer: system prompts of ~`system_tokens`.
    sessions = text_workload(corpus, seed=0, systems=4, shared_requests=8 if quick else 16, chats=4 if quick else 8,
                             turns=3, system_chars=3 * args.system_tokens, user_chars=3 * args.user_tokens)
    with bench_ray(num_cpus=4):
        return measure(Path(model.path), sessions, concurrency=4, answer_tokens=args.answer_tokens,
                       block_tokens=args.block_tokens)
