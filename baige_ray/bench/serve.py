"""Serving engines side by side: tokens/s, time to first token and inter-token latency at 1, 8, 32 streams.

Each level runs `streams` client threads for `--seconds`, each sending one request after another
(prompts of mixed lengths from local text, `--new-tokens` each, temperature 1, seeded) to:

- `builtin`: the continuous-batching engine with its KV cache (serving/engine.py) on its own thread,
  as a replica runs it; tokens are timed as they stream out;
- `vllm` (vLLM installed): vLLM's engine in this process (serving/vllm_engine.py) on the same weights,
  loaded from the model's Hugging Face directory (the reference GPT as GPT-2), stepped and timed
  exactly like `builtin`;
- `sampler`: what replicas ran before it: requests grouped as `@serve.batch` did (up to 8, 10 ms
  wait), then generated together; the reference GPT re-runs its window for every token
  (models/gpt_decoding.py), a Hugging Face model runs the length-grouped cached loop
  (causal_lm_generation.py). It does not stream: the first token arrives with the last.

All run in this process on one intra-op thread each (a replica's setting), on the same weights.
Latencies are per request (TTFT) and per token gap (ITL), as p50 and p99; throughput counts
generated tokens over the level's wall time. The HTTP layer in front is the same for every engine
and is left out.

With vLLM, `handoff` compares giving the running engine a new state in memory with restarting it
from a checkpoint written to disk (bench/serve_vllm.py). When vLLM was asked for and could not run,
or failed, `vllm_skipped` says why and the other systems' figures stand.
"""

from __future__ import annotations

import argparse
import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_SAMPLER_BATCH = 8
SAMPLER_WAIT_S = 0.01
SYSTEMS = ("builtin", "vllm", "sampler")
FAILURE_POLL_S = 0.5  # how often a waiting client checks that the engine's thread is still alive
CONTEXT = 256  # both models' positions
MAX_PROMPT_TOKENS = 8 + 119  # the longest prompt build_setup makes; it and the new tokens must fit CONTEXT


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=["gpt", "llama-tiny"], default="gpt")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--seconds", type=float, default=6.0, help="measured time per level and engine")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS,
                        help="vllm runs where vLLM is installed; elsewhere the result says why it did not")


def check_arguments(args: argparse.Namespace) -> None:
    if not args.streams or any(streams < 1 for streams in args.streams):
        raise ValueError(f"--streams={args.streams} is invalid: expected one or more counts >= 1")
    if not args.seconds > 0:
        raise ValueError(f"--seconds={args.seconds} is invalid: expected > 0")
    if not 1 <= args.new_tokens <= CONTEXT - MAX_PROMPT_TOKENS:
        raise ValueError(f"--new-tokens={args.new_tokens} is invalid: expected 1 to {CONTEXT - MAX_PROMPT_TOKENS}, "
                         f"so that prompts of up to {MAX_PROMPT_TOKENS} tokens and the new ones fit the models' "
                         f"context of {CONTEXT} (the engines refuse, not cut, a prompt that does not fit)")


@dataclass
class LatencyRecord:
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


@dataclass
class BenchSetup:
    generator: Any  # TextGenerator: the built-in engine's decoder and the prompts' tokenizer
    sample: Callable[[list[list[int]], list[Any]], None]  # the previous sampler on a batch
    prompts: list[list[int]]
    model: Any  # the model's config: GPTConfig or HFModel (its directory is what vLLM reads)
    weights: dict[str, Any]


def build_setup(model_name: str, tmp: str) -> BenchSetup:
    import sysconfig

    import torch

    from baige_ray.models.plugin import plugin_for
    from baige_ray.serving.generators import text_generator

    torch.manual_seed(0)
    if model_name == "gpt":
        from baige_ray.models.gpt import GPTConfig

        config = GPTConfig(seq_len=CONTEXT, num_layers=4, num_heads=4, hidden=256)
    else:
        from baige_ray.models.hf.tiny import make_llama_tiny

        config, _ = make_llama_tiny(tmp, seq_len=CONTEXT)
    plugin = plugin_for(config)
    weights = plugin.build_model().state_dict()
    generator = text_generator(plugin, weights)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((stdlib / name).read_text() for name in ("textwrap.py", "shlex.py", "string.py"))
    prompts = []
    for index in range(64):
        start = (index * 997) % (len(text) - 400)
        prompts.append(generator.encode(text[start : start + 20 + (index * 37) % 300])[: 8 + (index * 13) % 120])
    return BenchSetup(generator, _sampler_for(model_name, generator), prompts, config, weights)


def _sampler_for(model_name: str, generator):
    if model_name == "gpt":
        from baige_ray.models.gpt_decoding import generate_from_tokens
        from baige_ray.serving.requests import GenerateRequest

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


def _builtin_engine(generator, max_batch_size: int):
    from baige_ray.serving.engine import ContinuousBatchingEngine, EngineLimits

    return ContinuousBatchingEngine(generator.decoder, eos_token_id=None,
                                    limits=EngineLimits(max_batch_size=max_batch_size))


def _run_engine(engine, prompts, streams: int, seconds: float, new_tokens: int) -> LatencyRecord:
    """`engine`: the built-in one or vLLM's (submit / step / wait_for_work), stepped on one thread."""
    from baige_ray.serving.causal_lm_generation import SamplingParams

    def loop(stop: threading.Event) -> None:
        while not stop.is_set():
            if not engine.step():
                engine.wait_for_work(0.01)

    def one(index: int, record: LatencyRecord, failed: threading.Event) -> None:
        done = threading.Event()
        times: list[float] = []
        submitted = time.perf_counter()
        engine.submit(prompts[index % len(prompts)],
                      SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=index),
                      lambda event: done.set() if event.token is None else times.append(time.perf_counter()))
        if not _wait(done, failed):
            return
        record.ttft_s.append(times[0] - submitted)
        record.itl_s.extend(b - a for a, b in zip(times, times[1:]))
        record.tokens += len(times)
        record.requests += 1

    with _background(loop) as failed:
        return drive_clients(one, streams, seconds, failed)


def _run_sampler(sample, prompts, streams: int, seconds: float, new_tokens: int) -> LatencyRecord:
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

    def one(index: int, record: LatencyRecord, failed: threading.Event) -> None:
        done = threading.Event()
        submitted = time.perf_counter()
        inbox.put((prompts[index % len(prompts)], SamplingParams(max_new_tokens=new_tokens, temperature=1.0,
                                                                 seed=index), done))
        if not _wait(done, failed):
            return
        record.ttft_s.append(time.perf_counter() - submitted)  # nothing streams: every token comes at the end
        record.tokens += new_tokens
        record.requests += 1

    with _background(batcher) as failed:
        return drive_clients(one, streams, seconds, failed)


@contextlib.contextmanager
def _background(work: Callable[[threading.Event], None]) -> Iterator[threading.Event]:
    """Run `work(stop)` on a thread for the duration of the block; set `stop` and join after.

    Yields `failed`, set if `work` raised, so that clients waiting on it stop instead of waiting
    forever; its error is raised when the block ends."""
    stop, failed = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def guarded() -> None:
        try:
            work(stop)
        except BaseException as error:
            errors.append(error)
            failed.set()

    thread = threading.Thread(target=guarded, daemon=True)
    thread.start()
    try:
        yield failed
    finally:
        stop.set()
        thread.join()
    if errors:
        raise RuntimeError(f"the engine's thread failed: {errors[0]!r}") from errors[0]


def _wait(done: threading.Event, failed: threading.Event) -> bool:
    """Wait for `done`; False when the thread serving the request failed first."""
    while not done.wait(FAILURE_POLL_S):
        if failed.is_set():
            return False
    return True


def drive_clients(one, streams: int, seconds: float, failed: threading.Event) -> LatencyRecord:
    """`streams` client threads, each sending requests back to back until `seconds` have passed."""
    record = LatencyRecord()
    deadline = time.perf_counter() + seconds
    counter = iter(range(10**9))
    lock = threading.Lock()

    def client() -> None:
        while time.perf_counter() < deadline and not failed.is_set():
            with lock:
                index = next(counter)
            one(index, record, failed)

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    record.elapsed_s = time.perf_counter() - started
    return record


def latency_summary(record: LatencyRecord) -> dict[str, Any]:
    return {
        "tokens_per_s": round(record.tokens / record.elapsed_s, 1), "requests": record.requests,
        "ttft_p50_s": _percentile(record.ttft_s, 0.5), "ttft_p99_s": _percentile(record.ttft_s, 0.99),
        "itl_p50_s": _percentile(record.itl_s, 0.5), "itl_p99_s": _percentile(record.itl_s, 0.99),
    }


def ratios(row: dict[str, Any]) -> dict[str, float]:
    """Throughput ratios between the systems a level ran (`builtin_vs_sampler`, `vllm_vs_builtin`, ...)."""
    pairs = (("builtin", "sampler"), ("vllm", "sampler"), ("vllm", "builtin"))
    return {f"{a}_vs_{b}": round(row[a]["tokens_per_s"] / row[b]["tokens_per_s"], 2)
            for a, b in pairs if a in row and b in row and row[b]["tokens_per_s"] > 0}


@dataclass
class _VLLM:
    engine: Any = None
    skipped: str | None = None  # why vLLM is not, or no longer, measured


def _describe(error: Exception) -> str:
    return f"{type(error).__name__}: {error}".strip()


def _start_vllm(setup: BenchSetup, args: argparse.Namespace, max_batch_size: int, tmp: str) -> _VLLM:
    import os

    from baige_ray.bench import serve_vllm
    from baige_ray.models.plugin import plugin_for

    if "vllm" not in args.systems:
        return _VLLM()
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # before vLLM's import: stdout is the result's
    reason = serve_vllm.unavailable_reason()
    if reason is not None:
        return _VLLM(skipped=reason)
    try:
        directory = plugin_for(setup.model).save_hf_directory(Path(tmp) / "served", setup.weights, step=0)
        engine = serve_vllm.build_engine(setup.model, directory, max_batch_size=max_batch_size,
                                         max_context=setup.generator.decoder.max_context)
        _run_engine(engine, setup.prompts, 2, 1.0, args.new_tokens)  # warm up
    except Exception as error:  # vLLM's failures belong in the result beside the other systems' figures
        return _VLLM(skipped=f"vLLM could not start: {_describe(error)}")
    return _VLLM(engine)


def _handoff(engine, setup: BenchSetup, directory: Path, max_batch_size: int) -> dict[str, Any] | str:
    from baige_ray.bench import serve_vllm

    try:
        return serve_vllm.measure_handoff(engine, setup.model, directory, setup.prompts,
                                          max_batch_size=max_batch_size)
    except Exception as error:
        return f"handoff failed: {_describe(error)}"


def run(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    import torch

    check_arguments(args)
    torch.set_num_threads(1)  # before vLLM starts: its CPU worker turns later calls into no-ops
    started = time.perf_counter()
    max_batch_size = max(32, *args.streams)
    with tempfile.TemporaryDirectory(prefix="baige-bench-serve-") as tmp:
        setup = build_setup(args.model, tmp)
        builtin = _builtin_engine(setup.generator, max_batch_size)
        if "builtin" in args.systems:  # warm every path up
            _run_engine(builtin, setup.prompts, 2, 1.0, args.new_tokens)
        if "sampler" in args.systems:
            _run_sampler(setup.sample, setup.prompts, 2, 1.0, args.new_tokens)
        vllm = _start_vllm(setup, args, max_batch_size, tmp)
        levels: dict[str, dict[str, Any]] = {}
        for streams in args.streams:
            row: dict[str, Any] = {}
            if "builtin" in args.systems:
                row["builtin"] = latency_summary(_run_engine(builtin, setup.prompts, streams, args.seconds,
                                                             args.new_tokens))
            if vllm.engine is not None:
                try:
                    row["vllm"] = latency_summary(_run_engine(vllm.engine, setup.prompts, streams, args.seconds,
                                                              args.new_tokens))
                except Exception as error:
                    vllm = _VLLM(skipped=f"vLLM failed at {streams} streams: {_describe(error)}")
            if "sampler" in args.systems:
                row["sampler"] = latency_summary(_run_sampler(setup.sample, setup.prompts, streams, args.seconds,
                                                              args.new_tokens))
            levels[str(streams)] = {**row, **ratios(row)}
        result: dict[str, Any] = {"model": args.model, "new_tokens": args.new_tokens, "seconds": args.seconds,
                                  "levels": levels}
        if vllm.engine is not None:
            result["handoff"] = _handoff(vllm.engine, setup, Path(tmp) / "checkpoint", max_batch_size)
        if vllm.skipped is not None:
            result["vllm_skipped"] = vllm.skipped
    result["bench_s"] = round(time.perf_counter() - started, 1)
    return result


def summarize(result: dict[str, Any]) -> str:
    lines = [f"model {result['model']}, {result['new_tokens']} new tokens per request"]
    for streams, row in result["levels"].items():
        for name in SYSTEMS:
            if name in row:
                r = row[name]
                lines.append(f"{streams:>3} streams {name:8s} {r['tokens_per_s']:8.1f} tok/s  "
                             f"TTFT p50 {r['ttft_p50_s']} p99 {r['ttft_p99_s']}  ITL p50 {r['itl_p50_s']} p99 {r['itl_p99_s']}")
        lines.extend(f"    {key.replace('_vs_', '/')} throughput: {value}x"
                     for key, value in row.items() if "_vs_" in key)
    handoff = result.get("handoff")
    if isinstance(handoff, dict):
        lines.append(f"vLLM handoff: in memory {handoff['reload_in_memory_s']} s, restart from a checkpoint "
                     f"{handoff['restart_s']} s (write {handoff['checkpoint_write_s']} s, load "
                     f"{handoff['engine_from_checkpoint_s']} s), same greedy tokens: {handoff['same_greedy_tokens']}")
    elif handoff is not None:
        lines.append(f"vLLM handoff: {handoff}")
    if "vllm_skipped" in result:
        lines.append(f"vllm: {result['vllm_skipped']}")
    return "\n".join(lines)
