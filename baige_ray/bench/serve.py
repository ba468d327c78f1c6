"""Serving engines side by side: tokens/s, time to first token and inter-token latency at 1, 8, 32 streams.

Each level runs `streams` client threads for `--seconds`, each sending one request after another
(prompts of mixed lengths from local text, `--new-tokens` each, temperature 1, seeded) to:

- `engine`: the continuous-batching engine with its KV cache (serving/engine.py) on its own thread,
  as a replica runs it; tokens are timed as they stream out;
- `sampler`: what replicas ran before it: requests grouped as `@serve.batch` did (up to 8, 10 ms
  wait), then generated together; the reference GPT re-runs its window for every token
  (serving/sampling.py), a Hugging Face model runs the length-grouped cached loop
  (causal_lm_generation.py). It does not stream: the first token arrives with the last.

Both run in this process on one intra-op thread each (a replica's setting), on the same weights.
Latencies are per request (TTFT) and per token gap (ITL), as p50 and p99; throughput counts
generated tokens over the level's wall time. The HTTP layer in front is the same for every engine
and is left out. vLLM is not in this comparison yet (see the issue's note).
"""

from __future__ import annotations

import argparse
import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

MAX_SAMPLER_BATCH = 8
SAMPLER_WAIT_S = 0.01


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=["gpt", "llama-tiny"], default="gpt")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--seconds", type=float, default=6.0, help="measured time per level and engine")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--systems", nargs="+", default=["engine", "sampler"], choices=["engine", "sampler"])


@dataclass
class _Record:
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    tokens: int = 0
    requests: int = 0
    elapsed_s: float = 0.0


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 5)


def _build(model_name: str, tmp: str):
    """(TextGenerator, sampler(prompts, params) -> token lists, prompt token lists)."""
    import torch

    import sysconfig
    from pathlib import Path

    from baige_ray.models.plugin import plugin_for

    torch.manual_seed(0)
    if model_name == "gpt":
        from baige_ray.models.gpt import GPTConfig

        config = GPTConfig(seq_len=256, num_layers=4, num_heads=4, hidden=256)
    else:
        from baige_ray.models.hf.tiny import make_llama_tiny

        config, _ = make_llama_tiny(tmp, seq_len=256)
    plugin = plugin_for(config)
    generator = plugin.build_text_generator(plugin.build_model().state_dict())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((stdlib / name).read_text() for name in ("textwrap.py", "shlex.py", "string.py"))
    prompts = []
    for index in range(64):
        start = (index * 997) % (len(text) - 400)
        prompts.append(generator.encode(text[start : start + 20 + (index * 37) % 300])[: 8 + (index * 13) % 120])
    return generator, _sampler_for(model_name, generator), prompts


def _sampler_for(model_name: str, generator):
    if model_name == "gpt":
        from baige_ray.serving.requests import GenerateRequest
        from baige_ray.serving.sampling import generate_from_tokens

        def sample_gpt(prompts, params):  # today's byte-GPT path: grouped by prompt length, no cache
            requests = [GenerateRequest(prompt="", max_new_tokens=p.max_new_tokens, temperature=p.temperature,
                                        seed=p.seed) for p in params]
            generate_from_tokens(generator.decoder.model, prompts, requests)
        return sample_gpt
    from baige_ray.serving.causal_lm_generation import generate_batch

    def sample_hf(prompts, params):
        generate_batch(generator.decoder.model, prompts, params, eos_token_id=None,
                       max_context=generator.decoder.max_context)
    return sample_hf


def _run_engine(generator, prompts, streams: int, seconds: float, new_tokens: int) -> _Record:
    from baige_ray.serving.causal_lm_generation import SamplingParams
    from baige_ray.serving.engine import ContinuousBatchingEngine, EngineLimits

    engine = ContinuousBatchingEngine(generator.decoder, eos_token_id=None,
                                      limits=EngineLimits(max_batch_size=max(32, streams)))
    def loop(stop: threading.Event) -> None:
        while not stop.is_set():
            if not engine.step():
                engine.wait_for_work(0.01)

    def one(index: int, record: _Record) -> None:
        done = threading.Event()
        times: list[float] = []
        submitted = time.perf_counter()
        engine.submit(prompts[index % len(prompts)],
                      SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=index),
                      lambda event: done.set() if event.token is None else times.append(time.perf_counter()))
        done.wait()
        record.ttft_s.append(times[0] - submitted)
        record.itl_s.extend(b - a for a, b in zip(times, times[1:]))
        record.tokens += len(times)
        record.requests += 1

    with _background(loop):
        return _drive(one, streams, seconds)


def _run_sampler(sample, prompts, streams: int, seconds: float, new_tokens: int) -> _Record:
    from baige_ray.serving.causal_lm_generation import SamplingParams

    inbox: queue.Queue = queue.Queue()

    def batcher(stop: threading.Event) -> None:  # @serve.batch: the first request waits up to 10 ms for up to 7 more
        while not stop.is_set():
            try:
                batch = [inbox.get(timeout=0.05)]
            except queue.Empty:
                continue
            deadline = time.perf_counter() + SAMPLER_WAIT_S
            while len(batch) < MAX_SAMPLER_BATCH and (left := deadline - time.perf_counter()) > 0:
                try:
                    batch.append(inbox.get(timeout=left))
                except queue.Empty:
                    break
            sample([item[0] for item in batch], [item[1] for item in batch])
            for item in batch:
                item[2].set()

    def one(index: int, record: _Record) -> None:
        done = threading.Event()
        submitted = time.perf_counter()
        inbox.put((prompts[index % len(prompts)], SamplingParams(max_new_tokens=new_tokens, temperature=1.0,
                                                                 seed=index), done))
        done.wait()
        record.ttft_s.append(time.perf_counter() - submitted)  # nothing streams: every token comes at the end
        record.tokens += new_tokens
        record.requests += 1

    with _background(batcher):
        return _drive(one, streams, seconds)


@contextlib.contextmanager
def _background(work: Callable[[threading.Event], None]) -> Iterator[None]:
    """Run `work(stop)` on a thread for the duration of the block; set `stop` and join after."""
    stop = threading.Event()
    thread = threading.Thread(target=work, args=(stop,), daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _drive(one, streams: int, seconds: float) -> _Record:
    """`streams` client threads, each sending requests back to back until `seconds` have passed."""
    record = _Record()
    deadline = time.perf_counter() + seconds
    counter = iter(range(10**9))
    lock = threading.Lock()

    def client() -> None:
        while time.perf_counter() < deadline:
            with lock:
                index = next(counter)
            one(index, record)

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    record.elapsed_s = time.perf_counter() - started
    return record


def _summary(record: _Record) -> dict[str, Any]:
    return {
        "tokens_per_s": round(record.tokens / record.elapsed_s, 1), "requests": record.requests,
        "ttft_p50_s": _percentile(record.ttft_s, 0.5), "ttft_p99_s": _percentile(record.ttft_s, 0.99),
        "itl_p50_s": _percentile(record.itl_s, 0.5), "itl_p99_s": _percentile(record.itl_s, 0.99),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    import torch

    torch.set_num_threads(1)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="baige-bench-serve-") as tmp:
        generator, sample, prompts = _build(args.model, tmp)
        _run_engine(generator, prompts, 2, 1.0, args.new_tokens)  # warm both paths up
        _run_sampler(sample, prompts, 2, 1.0, args.new_tokens)
        levels: dict[str, dict[str, Any]] = {}
        for streams in args.streams:
            row: dict[str, Any] = {}
            if "engine" in args.systems:
                row["engine"] = _summary(_run_engine(generator, prompts, streams, args.seconds, args.new_tokens))
            if "sampler" in args.systems:
                row["sampler"] = _summary(_run_sampler(sample, prompts, streams, args.seconds, args.new_tokens))
            if len(row) == 2:
                row["engine_vs_sampler"] = round(row["engine"]["tokens_per_s"] / row["sampler"]["tokens_per_s"], 2)
            levels[str(streams)] = row
    return {"model": args.model, "new_tokens": args.new_tokens, "seconds": args.seconds, "levels": levels,
            "bench_s": round(time.perf_counter() - started, 1)}


def summarize(result: dict[str, Any]) -> str:
    lines = [f"model {result['model']}, {result['new_tokens']} new tokens per request"]
    for streams, row in result["levels"].items():
        for name in ("engine", "sampler"):
            if name in row:
                r = row[name]
                lines.append(f"{streams:>3} streams {name:8s} {r['tokens_per_s']:8.1f} tok/s  "
                             f"TTFT p50 {r['ttft_p50_s']} p99 {r['ttft_p99_s']}  ITL p50 {r['itl_p50_s']} p99 {r['itl_p99_s']}")
        if "engine_vs_sampler" in row:
            lines.append(f"    engine/sampler throughput: {row['engine_vs_sampler']}x")
    return "\n".join(lines)
