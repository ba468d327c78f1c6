"""Prefill/decode disaggregation against colocated replicas on the same load: tokens/s, TTFT, ITL.

Two Serve applications of the same model on the same number of replicas run one after the other on
a local Ray instance (or RAY_ADDRESS), and each gets the same load at every `--streams` level:
that many client threads, each sending one request after another for `--seconds` (the same 64
prompts of 8-127 tokens from local text, in the same order, `--new-tokens` each, temperature 1,
seeded). The systems:

- `colocated`: `--replicas` replicas, each prefilling and decoding in its own continuous batch;
- `disaggregated`: `--prefill-replicas` prefill replicas and the rest decode replicas; each request's
  prompt cache goes from a prefill replica to a decode replica through Ray's object store.

Requests go to the application's ingress replicas through a deployment handle, streaming token ids
(`token_stream`), so tokens are timed one by one; the HTTP proxy, the same for both, is left out.
TTFT is per request, ITL per gap between a request's tokens, both as p50 and p99; throughput counts
tokens over the level's wall time. Before the load, a few greedy requests check that both systems
return the same tokens.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

SYSTEMS = ("colocated", "disaggregated")
NUM_GREEDY_CHECKS = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=["gpt", "llama-tiny"], default="gpt")
    parser.add_argument("--replicas", type=int, default=2, help="replicas per system (devices)")
    parser.add_argument("--prefill-replicas", type=int, default=1, help="of --replicas, those that prefill")
    parser.add_argument("--streams", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--seconds", type=float, default=10.0, help="measured time per level and system")
    parser.add_argument("--new-tokens", type=int, default=32)


def check_arguments(args: argparse.Namespace) -> None:
    from baige_ray.bench.serve import check_arguments as check_load

    check_load(args)  # --streams, --seconds, --new-tokens
    if args.replicas < 2:
        raise ValueError(f"--replicas={args.replicas} is invalid: expected >= 2 (one prefill and one decode replica)")
    if not 1 <= args.prefill_replicas < args.replicas:
        raise ValueError(f"--prefill-replicas={args.prefill_replicas} is invalid: expected 1 to --replicas - 1 "
                         f"({args.replicas - 1})")


def _serve(system: str, setup, args: argparse.Namespace, max_batch_size: int):
    import socket

    import ray

    from baige_ray.serving import serve
    from baige_ray.serving.disaggregation import DisaggregationOptions

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    options: dict[str, Any] = {"num_replicas": args.replicas}
    if system == "disaggregated":
        options = {"disaggregation": DisaggregationOptions(prefill_replicas=args.prefill_replicas,
                                                           decode_replicas=args.replicas - args.prefill_replicas)}
    return serve((0, ray.put(setup.weights)), model_config=setup.model, name=f"bench-pd-{system}", port=port,
                 max_batch_size=max_batch_size, max_ongoing_requests=max_batch_size, **options)


def _run_level(handle, prompts: list[list[int]], streams: int, seconds: float, new_tokens: int):
    import threading

    from baige_ray.bench.serve import LatencyRecord, drive_clients
    from baige_ray.serving.causal_lm_generation import SamplingParams

    def one(index: int, record: LatencyRecord, failed: threading.Event) -> None:
        params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=index)
        submitted = time.perf_counter()
        times = [time.perf_counter() for _ in handle.token_stream.remote(prompts[index % len(prompts)], params)]
        record.ttft_s.append(times[0] - submitted)
        record.itl_s.extend(b - a for a, b in zip(times, times[1:]))
        record.tokens += len(times)
        record.requests += 1

    return drive_clients(one, streams, seconds, threading.Event())


def _greedy_tokens(handle, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from baige_ray.serving.causal_lm_generation import SamplingParams

    greedy = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    return [list(handle.token_stream.remote(prompt, greedy)) for prompt in prompts[:NUM_GREEDY_CHECKS]]


def _measure(system: str, setup, args: argparse.Namespace, max_batch_size: int) -> tuple[dict, list[list[int]]]:
    from ray import serve as ray_serve

    from baige_ray.bench.serve import latency_summary
    from baige_ray.serving import shutdown

    started = time.perf_counter()
    info = _serve(system, setup, args, max_batch_size)
    startup_s = time.perf_counter() - started
    try:
        handle = ray_serve.get_deployment_handle(info.deployment_name, app_name=info.app_name).options(stream=True)
        greedy = _greedy_tokens(handle, setup.prompts, args.new_tokens)
        _run_level(handle, setup.prompts, 2, 1.0, args.new_tokens)  # warm up every replica's path
        levels = {str(streams): latency_summary(_run_level(handle, setup.prompts, streams, args.seconds,
                                                           args.new_tokens))
                  for streams in args.streams}
    finally:
        shutdown(info)
    return {"startup_s": round(startup_s, 1), "levels": levels}, greedy


def run(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    from ray import serve as ray_serve

    from baige_ray.bench.measure import bench_ray
    from baige_ray.bench.serve import build_setup

    check_arguments(args)
    started = time.perf_counter()
    max_batch_size = max(32, *args.streams)
    measured: dict[str, dict] = {}
    greedy: dict[str, list[list[int]]] = {}
    with tempfile.TemporaryDirectory(prefix="baige-bench-pd-") as tmp, bench_ray(num_cpus=4):
        setup = build_setup(args.model, tmp)
        try:
            for system in SYSTEMS:
                measured[system], greedy[system] = _measure(system, setup, args, max_batch_size)
        finally:
            ray_serve.shutdown()
    levels = {level: {system: measured[system]["levels"][level] for system in SYSTEMS}
              for level in map(str, args.streams)}
    for row in levels.values():
        row.update(ratios(row))
    return {
        "model": args.model, "replicas": args.replicas, "prefill_replicas": args.prefill_replicas,
        "decode_replicas": args.replicas - args.prefill_replicas, "new_tokens": args.new_tokens,
        "seconds": args.seconds, "mean_prompt_tokens": round(sum(map(len, setup.prompts)) / len(setup.prompts), 1),
        "levels": levels, "same_greedy_tokens": greedy["colocated"] == greedy["disaggregated"],
        "startup_s": {system: measured[system]["startup_s"] for system in SYSTEMS},
        "bench_s": round(time.perf_counter() - started, 1),
    }


def ratios(row: dict[str, Any]) -> dict[str, float]:
    """Disaggregated over colocated: throughput, and p50 TTFT and ITL (below 1: disaggregation is faster)."""
    split, colocated = row["disaggregated"], row["colocated"]
    out = {}
    if colocated["tokens_per_s"] > 0:
        out["throughput_ratio"] = round(split["tokens_per_s"] / colocated["tokens_per_s"], 2)
    for key in ("ttft_p50_s", "itl_p50_s"):
        if split[key] is not None and colocated[key]:
            out[f"{key.removesuffix('_s')}_ratio"] = round(split[key] / colocated[key], 2)
    return out


def summarize(result: dict[str, Any]) -> str:
    lines = [f"model {result['model']}: {result['replicas']} replicas colocated against {result['prefill_replicas']} "
             f"prefill + {result['decode_replicas']} decode; {result['new_tokens']} new tokens per request, "
             f"prompts of {result['mean_prompt_tokens']} tokens on average"]
    for streams, row in result["levels"].items():
        for name in SYSTEMS:
            r = row[name]
            lines.append(f"{streams:>3} streams {name:13s} {r['tokens_per_s']:8.1f} tok/s  TTFT p50 {r['ttft_p50_s']} "
                         f"p99 {r['ttft_p99_s']}  ITL p50 {r['itl_p50_s']} p99 {r['itl_p99_s']}")
        ratio = ", ".join(f"{key.removesuffix('_ratio')} {value}x" for key, value in row.items()
                          if key.endswith("_ratio"))
        lines.append(f"    disaggregated/colocated: {ratio}")
    lines.append(f"same greedy tokens: {result['same_greedy_tokens']}")
    return "\n".join(lines)
