"""Prefix reuse in the built-in engine: TTFT and tokens/s with and without the prefix cache, and from lower tiers.

A workload generated here (seeded): requests sharing long system prompts (several prompts, many
requests each) and multi-turn chats (each turn's prompt is the one before, its answer and a new
user message). A Llama-architecture model built from its config with `transformers` runs in one
built-in engine (`ContinuousBatchingEngine`); `--concurrency` clients each keep one request in
flight (closed loop: a chat's next turn is sent when its answer is complete). Per run: TTFT p50 /
p99 (submit to first token), generated tokens/s, hits per tier, bytes moved between tiers.

- `reuse` against `none`: the same engine with the prefix cache (device tier large enough for
  everything) and without, at each concurrency; the greedy tokens of both must be equal.
- `tiers`: many system prompts visited in turn, the device tier a quarter of the working set, the
  host tier another quarter and the rest on disk, so most hits come from host memory and disk.

- `handoff`: prefill/decode disaggregation in this process, the same sessions one turn at a time, with a
  prefix cache on both sides and without: the keys and values the hand-offs carried (bench/prefix_handoff.py).
- `routing`: the hit rate of 2 replicas behind `serve(..., routing="prefix")` over one replica's, against
  Serve's default routing, on a text workload of the same kind through the `openai` client
  (bench/prefix_routing.py; `--no-routing` leaves it out).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from baige_ray.bench.measure import report_stage
from baige_ray.bench.prefix_handoff import measure_handoffs
from baige_ray.bench.prefix_routing import run_routing

# Grouped-query attention as in the models users serve (2 KV heads of 64): keys and values are small
# beside the compute that makes them, which is what makes keeping them pay.
MODEL_SHAPE = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 6, "num_attention_heads": 8,
               "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 2048}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--system-tokens", type=int, default=512, help="tokens of each shared system prompt")
    parser.add_argument("--user-tokens", type=int, default=32, help="tokens of each user message")
    parser.add_argument("--answer-tokens", type=int, default=16, help="new tokens per request (greedy)")
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="fewer requests, concurrency 4 only")
    parser.add_argument("--work-dir", default=None, help="the disk tier's directory (default: a temp dir)")
    parser.add_argument("--no-routing", action="store_true", help="leave out routing over 2 served replicas")


@dataclass(frozen=True)
class Session:
    """One client's conversation: a system prompt, then user messages, one turn each."""

    system: tuple[int, ...]
    messages: tuple[tuple[int, ...], ...]


def workload(*, seed: int, systems: int, shared_requests: int, chats: int, turns: int, system_tokens: int,
             user_tokens: int, vocab: int) -> list[Session]:
    """Single-turn requests over `systems` shared system prompts, visited in turn, then `chats` chats of
    `turns` turns, each with a system prompt of its own; sessions interleaved."""
    rng = np.random.default_rng(seed)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(int(t) for t in rng.integers(0, vocab, n))

    prompts = [tokens(system_tokens) for _ in range(systems)]
    shared = [Session(system=prompts[i % systems], messages=(tokens(user_tokens),)) for i in range(shared_requests)]
    talks = [Session(system=tokens(system_tokens), messages=tuple(tokens(user_tokens) for _ in range(turns)))
             for _ in range(chats)]
    mixed = []
    for index in range(max(len(shared), len(talks))):
        mixed += ([shared[index]] if index < len(shared) else []) + ([talks[index]] if index < len(talks) else [])
    return mixed


@dataclass
class RunResult:
    ttft_s: list[float] = field(default_factory=list)
    answers: list[list[int]] = field(default_factory=list)
    generated: int = 0
    seconds: float = 0.0
    cache: dict | None = None

    def summary(self) -> dict[str, Any]:
        return {"requests": len(self.ttft_s), "ttft_p50_s": float(np.percentile(self.ttft_s, 50)),
                "ttft_p99_s": float(np.percentile(self.ttft_s, 99)), "tokens_per_s": self.generated / self.seconds,
                "seconds": self.seconds, "cache": self.cache}


class _Client:
    """Runs one session's turns back to back on the engine, recording each turn's TTFT and answer."""

    def __init__(self, session: Session, result: RunResult, answer_tokens: int):
        self.session, self.result, self.answer_tokens = session, result, answer_tokens
        self.prompt: list[int] = list(session.system)
        self.turn, self.tokens, self.submitted, self.done = 0, [], 0.0, False

    def submit(self, engine) -> None:
        from baige_ray.serving.causal_lm_generation import SamplingParams

        self.prompt += list(self.session.messages[self.turn])
        self.tokens, self.submitted = [], time.perf_counter()
        engine.submit(self.prompt, SamplingParams(max_new_tokens=self.answer_tokens, temperature=0.0), self.on_event)

    def on_event(self, event) -> None:
        if event.token is not None:
            if not self.tokens:
                self.result.ttft_s.append(time.perf_counter() - self.submitted)
            self.tokens.append(event.token)
            self.result.generated += 1
            return
        self.result.answers.append(self.tokens)
        self.prompt += self.tokens
        self.turn += 1
        self.done = True


def run_engine(model, sessions: list[Session], *, concurrency: int, answer_tokens: int, store=None) -> RunResult:
    """The sessions through one engine, `concurrency` clients at a time (closed loop)."""
    from baige_ray.models.hf.decoding import HFDecoder
    from baige_ray.serving.engine import ContinuousBatchingEngine, EngineLimits

    engine = ContinuousBatchingEngine(HFDecoder(model, MODEL_SHAPE["max_position_embeddings"]), eos_token_id=None,
                                      limits=EngineLimits(max_batch_size=max(concurrency, 1)), prefixes=store)
    result, waiting, active = RunResult(), list(sessions), []
    start = time.perf_counter()
    while waiting or active:
        while len(active) < concurrency and waiting:
            client = _Client(waiting.pop(0), result, answer_tokens)
            client.submit(engine)
            active.append(client)
        engine.step()
        for client in [c for c in active if c.done]:
            client.done = False
            if client.turn < len(client.session.messages):
                client.submit(engine)
            else:
                active.remove(client)
    result.seconds = time.perf_counter() - start
    result.cache = store.report() if store is not None else None
    return result


def _model():
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**MODEL_SHAPE), dtype=torch.float32).eval()


def _store(block_tokens: int, device_bytes: int, host_bytes: int = 0, disk_bytes: int = 0, disk_dir: str | None = None):
    import torch

    from baige_ray.serving.kv_blocks import KVCacheConfig, PrefixBlockStore

    config = KVCacheConfig(block_tokens=block_tokens, device_bytes=device_bytes, host_bytes=host_bytes,
                           disk_bytes=disk_bytes, disk_dir=disk_dir)
    return PrefixBlockStore(config, torch.device("cpu"), namespace="bench-prefix")


def block_size_bytes(block_tokens: int) -> int:
    """Keys and values of one block over every layer, float32."""
    head_dim = MODEL_SHAPE["hidden_size"] // MODEL_SHAPE["num_attention_heads"]
    return 2 * 4 * MODEL_SHAPE["num_hidden_layers"] * MODEL_SHAPE["num_key_value_heads"] * head_dim * block_tokens


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(2)
    model = _model()
    quick = args.quick
    levels = [4] if quick else list(args.concurrency)
    sessions = workload(seed=0, systems=4, shared_requests=12 if quick else 32, chats=4 if quick else 8,
                        turns=3, system_tokens=args.system_tokens, user_tokens=args.user_tokens,
                        vocab=MODEL_SHAPE["vocab_size"])
    run_engine(model, sessions[:2], concurrency=2, answer_tokens=2)  # warm-up: first forwards are slow
    by_level, stages = {}, 2 * len(levels) + 3
    for index, level in enumerate(levels):
        report_stage(args, f"concurrency {level}: without reuse", 2 * index, stages)
        none = run_engine(model, sessions, concurrency=level, answer_tokens=args.answer_tokens)
        report_stage(args, f"concurrency {level}: with reuse", 2 * index + 1, stages)
        reuse = run_engine(model, sessions, concurrency=level, answer_tokens=args.answer_tokens,
                           store=_store(args.block_tokens, 1 << 30))
        by_level[level] = {"none": none.summary(), "reuse": reuse.summary(),
                           "tokens_equal": sorted(none.answers) == sorted(reuse.answers)}
    report_stage(args, "working set 4x the device tier", 2 * len(levels), stages)
    tiers = _tiers(model, args, quick)
    report_stage(args, "disaggregated hand-offs", 2 * len(levels) + 1, stages)
    from baige_ray.models.hf.decoding import HFDecoder

    handoff = measure_handoffs(HFDecoder(model, MODEL_SHAPE["max_position_embeddings"]), sessions[:8 if quick else 16],
                               answer_tokens=args.answer_tokens, store=lambda: _store(args.block_tokens, 1 << 30))
    report_stage(args, "routing over 2 served replicas", 2 * len(levels) + 2, stages)
    routing = None if args.no_routing else run_routing(args, MODEL_SHAPE, _work_dir(args))
    worst = min(levels, key=lambda level: by_level[level]["none"]["ttft_p50_s"] / by_level[level]["reuse"]["ttft_p50_s"])
    return {
        "ttft_p50_speedup": min(v["none"]["ttft_p50_s"] / v["reuse"]["ttft_p50_s"] for v in by_level.values()),
        "throughput_speedup": min(v["reuse"]["tokens_per_s"] / v["none"]["tokens_per_s"] for v in by_level.values()),
        "tier_ttft_p50_speedup": tiers["none"]["ttft_p50_s"] / tiers["tiered"]["ttft_p50_s"],
        "routing_hit_rate_vs_single": routing["routing_hit_rate_vs_single"] if routing else None,
        "default_routing_hit_rate_vs_single": routing["default_hit_rate_vs_single"] if routing else None,
        "handoff_bytes_ratio": handoff["bytes_ratio"], "handoff": handoff,
        "routing": routing,
        "tokens_equal": (all(v["tokens_equal"] for v in by_level.values()) and tiers["tokens_equal"]
                         and handoff["tokens_equal"]),
        "worst_concurrency": worst, "by_concurrency": by_level, "tiers": tiers,
        "workload": {"sessions": len(sessions), "system_tokens": args.system_tokens, "user_tokens": args.user_tokens,
                     "answer_tokens": args.answer_tokens, "block_tokens": args.block_tokens},
    }


def _tiers(model, args: argparse.Namespace, quick: bool) -> dict[str, Any]:
    """16 system prompts visited in turn: by the time one comes back, the device tier (a quarter of the
    working set) has let it go to host memory (another quarter) or disk."""
    systems = 8 if quick else 16
    sessions = workload(seed=1, systems=systems, shared_requests=3 * systems, chats=0, turns=1,
                        system_tokens=args.system_tokens, user_tokens=args.user_tokens, vocab=MODEL_SHAPE["vocab_size"])
    block = block_size_bytes(args.block_tokens)
    working_set = systems * (args.system_tokens + args.user_tokens + args.answer_tokens) // args.block_tokens * block
    directory = _work_dir(args) / "kv"
    store = _store(args.block_tokens, working_set // 4, working_set // 4, 2 * working_set, str(directory))
    none = run_engine(model, sessions, concurrency=1, answer_tokens=args.answer_tokens)
    tiered = run_engine(model, sessions, concurrency=1, answer_tokens=args.answer_tokens, store=store)
    return {"working_set_bytes": working_set, "device_bytes": working_set // 4, "host_bytes": working_set // 4,
            "none": none.summary(), "tiered": tiered.summary(), "tokens_equal": none.answers == tiered.answers}


def _work_dir(args: argparse.Namespace) -> Path:
    if args.work_dir is None:
        args.work_dir = tempfile.mkdtemp(prefix="bench-prefix-")
    return Path(args.work_dir)


def summarize(result: dict[str, Any]) -> str:
    lines = ["concurrency  reuse  TTFT p50 ms  TTFT p99 ms  tokens/s"]
    for level, runs in result["by_concurrency"].items():
        for name in ("none", "reuse"):
            r = runs[name]
            lines.append(f"{level:>11}  {name:<5} {1000 * r['ttft_p50_s']:>11.1f} {1000 * r['ttft_p99_s']:>12.1f} "
                         f"{r['tokens_per_s']:>9.1f}")
    tiers = result["tiers"]
    lines.append(f"working set {tiers['working_set_bytes'] / 2**20:.1f} MiB, device tier a quarter: TTFT p50 "
                 f"{1000 * tiers['none']['ttft_p50_s']:.1f} ms recomputed, {1000 * tiers['tiered']['ttft_p50_s']:.1f} ms "
                 f"from the tiers; hits {tiers['tiered']['cache']['hits']}")
    handoff = result["handoff"]
    cached, uncached = handoff["with_cache"], handoff["without_cache"]
    lines.append(f"disaggregated hand-offs: {cached['bytes'] / 2**20:.1f} MiB with prefix caches against "
                 f"{uncached['bytes'] / 2**20:.1f} MiB without ({cached['tokens_sent']} of {cached['prompt_tokens']} "
                 "prompt tokens sent)")
    for name, one in (result["routing"] or {}).get("runs", {}).items():
        lines.append(f"{name:>8} routing, {one['replicas']} replica(s): hit rate {one['hit_rate']:.3f}, TTFT p50 "
                     f"{1000 * one['ttft_p50_s']:.1f} ms, p99 {1000 * one['ttft_p99_s']:.1f} ms")
    lines.append(f"TTFT p50 speedup {result['ttft_p50_speedup']:.2f}x, tokens/s {result['throughput_speedup']:.2f}x, "
                 f"tiers {result['tier_ttft_p50_speedup']:.2f}x; tokens equal: {result['tokens_equal']}")
    return "\n".join(lines)
