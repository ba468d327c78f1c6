"""bench scale's serving part: the Hugging Face directory `fit` exported, served with vLLM by baige-ray's
`serve(directory, engine="vllm")` and by plain `vllm.LLM(model=directory)`, one after the other.

- `serve`: in a fresh local Ray (2 CPUs), requests sent as users send them, with the official `openai`
  client to the OpenAI-compatible `/v1/completions` on 127.0.0.1: `load_s` runs from the `serve(...)`
  call until the first completion has answered (the checkpoint read and verified, Ray Serve started,
  the replica's process, vLLM's import and engine, the weights handed over in memory); then `S`
  streams (threads) each send `--serve-requests` requests of one fixed prompt, `max_tokens` =
  `--serve-tokens`, temperature 0, and tokens/s is every completion token (the responses' `usage`)
  over the wall time from the first request sent to the last answer.
- `direct`: `vllm.LLM` in a subprocess of its own (its memory freed when it exits; nothing overlaps
  the served run): `load_s` from the process's start (vLLM's import included, as the replica imports
  it too) until a first `generate` of the same request has returned; then, per level, `--serve-requests`
  `generate` calls of `S` copies of the prompt (SamplingParams temperature 0, the same max_tokens,
  ignore_eos). The engine gets the settings baige-ray's replica gives vLLM (serving/vllm_engine.py:
  float32, max_model_len = the config's max_position_embeddings, max_num_seqs = serve's
  max_batch_size, eager mode, no prefix caching, a 1 GiB KV pool), so the ratio prices serving, not
  settings. Threads are each side's default, which on 2 cores comes to one OpenMP thread each: the
  replica sets torch.set_num_threads(1) (serving/deployment.py) and steps vLLM in that process;
  vllm.LLM's engine process binds its threads to the allowed cores but one, which it reserves for its
  front end (`omp_cores` reports the cores it bound, from vLLM's log).

`vllm_vs_direct` = served tokens/s / direct tokens/s at the most streams (per level in `by_streams`).

The OpenAI layer has no `ignore_eos`: a served request may stop at the tokenizer's end-of-text token
before max_tokens, so both sides count the tokens generated, and `mean_tokens` shows how many a request got.

`fit` exports the tokenizer of the model it trained (HFModel.tokenizer, which bench scale points at the
tokenizer it trains beside the model): vLLM and serve's replica both read it from the exported directory.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from baige_ray.bench.measure import free_port

APP_NAME = "scale-vllm"
PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    "
STREAMS = (1, 8)
REQUEST_TIMEOUT_S = 600.0  # one completion; the openai client retries none
DIRECT_TIMEOUT_S = 3600.0  # the whole vllm.LLM subprocess
SERVE_BATCH = 32  # serve()'s default max_batch_size: the replica's vLLM max_num_seqs


@dataclass(frozen=True)
class Load:
    """What every stream sends: `requests` completions of `prompt`, `max_tokens` each, greedy."""

    prompt: str = PROMPT
    max_tokens: int = 32
    requests: int = 3
    streams: tuple[int, ...] = STREAMS


@dataclass(frozen=True)
class EngineSettings:
    """vLLM's settings in serve's replica (vllm_engine.build_vllm_engine, vllm_engine._build_engine), which the
    direct run copies."""

    model: str
    dtype: str
    max_model_len: int
    max_num_seqs: int
    kv_cache_gib: int
    enforce_eager: bool = True
    enable_prefix_caching: bool = True  # vLLM's default, and the replica's
    seed: int = 0


def load_of(args) -> Load:
    """bench scale's --serve-tokens and --serve-requests."""
    return Load(max_tokens=getattr(args, "serve_tokens", Load.max_tokens),
                requests=getattr(args, "serve_requests", Load.requests))


def engine_settings(model_dir: Path) -> EngineSettings:
    from baige_ray.models.hf import HFModel
    from baige_ray.serving.vllm_engine import KV_CACHE_GIB, VLLMSettings

    model = HFModel(model_dir)
    return EngineSettings(model=str(model_dir), dtype=VLLMSettings.dtype, max_model_len=model.max_positions,
                          max_num_seqs=SERVE_BATCH, kv_cache_gib=KV_CACHE_GIB)


def measure_vllm(model_dir: Path, args, tmp: Path) -> dict[str, Any]:
    """Serve `model_dir` (fit's exported Hugging Face directory) with `serve(..., engine="vllm")` in a fresh
    local Ray, then load it with plain `vllm.LLM` in a subprocess; load times, tokens/s at 1 and 8 streams,
    and `vllm_vs_direct` (served / direct tokens/s at 8 streams)."""
    model_dir = Path(model_dir)
    load, settings = load_of(args), engine_settings(model_dir)
    served = _serve_in_fresh_ray(model_dir, load)
    direct = _direct_in_subprocess(settings, load, Path(tmp) / "vllm-direct.json")
    return summary(served, direct, load, settings)


def summary(served: dict, direct: dict, load: Load, settings: EngineSettings) -> dict[str, Any]:
    ratios = {str(n): _ratio(served["levels"][str(n)]["tokens_per_s"], direct["levels"][str(n)]["tokens_per_s"])
              for n in load.streams}
    return {
        "serve_load_s": served["load_s"], "direct_load_s": direct["load_s"],
        "serve_tokens_per_s": {n: r["tokens_per_s"] for n, r in served["levels"].items()},
        "direct_tokens_per_s": {n: r["tokens_per_s"] for n, r in direct["levels"].items()},
        "vllm_vs_direct": ratios[str(max(load.streams))], "vllm_vs_direct_by_streams": ratios,
        "serve": served, "direct": direct,
        "load": asdict(load), "engine": asdict(settings),
    }


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b > 0 else None


# -- serve ------------------------------------------------------------------------------------------

def _serve_in_fresh_ray(model_dir: Path, load: Load) -> dict[str, Any]:
    import ray

    ray.init(address="local", num_cpus=2, logging_level="WARNING", include_dashboard=False)
    try:
        return _serve(model_dir, load)
    finally:
        from ray import serve as ray_serve

        ray_serve.shutdown()
        ray.shutdown()


def _serve(model_dir: Path, load: Load) -> dict[str, Any]:
    from openai import OpenAI

    from baige_ray.serving import serve, shutdown

    started = time.perf_counter()
    info = serve(model_dir, name=APP_NAME, host="127.0.0.1", port=free_port(), engine="vllm",
                 max_batch_size=SERVE_BATCH)
    returned = time.perf_counter()
    try:
        client = OpenAI(base_url=f"{info.url}/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)
        first = _complete(client, load)
        answered = time.perf_counter()
        levels = {str(n): _served_level(client, load, n) for n in load.streams}
    finally:
        shutdown(info)
    return {"load_s": round(answered - started, 3), "serve_call_s": round(returned - started, 3),
            "first_completion_tokens": first["completion_tokens"], "prompt_tokens": first["prompt_tokens"],
            "levels": levels}


def _complete(client, load: Load) -> dict[str, Any]:
    reply = client.completions.create(model=APP_NAME, prompt=load.prompt, max_tokens=load.max_tokens, temperature=0)
    return {"prompt_tokens": reply.usage.prompt_tokens, "completion_tokens": reply.usage.completion_tokens,
            "finish_reason": reply.choices[0].finish_reason}


def _served_level(client, load: Load, streams: int) -> dict[str, Any]:
    """`streams` threads, each sending `load.requests` completions one after the other."""

    def stream(_: int) -> list[dict[str, Any]]:
        return [_complete(client, load) for _ in range(load.requests)]

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=streams) as pool:
        futures = [pool.submit(stream, index) for index in range(streams)]
        # every request is bounded by the client's timeout, so each stream is bounded by requests x timeout
        replies = [reply for future in futures for reply in future.result(timeout=REQUEST_TIMEOUT_S * load.requests)]
    elapsed = time.perf_counter() - started
    return _level(elapsed, [reply["completion_tokens"] for reply in replies],
                  stopped=sum(reply["finish_reason"] == "stop" for reply in replies))


def _level(elapsed: float, tokens: list[int], *, stopped: int) -> dict[str, Any]:
    return {"tokens_per_s": round(sum(tokens) / elapsed, 3), "seconds": round(elapsed, 3), "requests": len(tokens),
            "completion_tokens": sum(tokens), "mean_tokens": round(statistics.fmean(tokens), 2),
            "stopped_early": stopped}


# -- plain vllm.LLM ---------------------------------------------------------------------------------

def _direct_in_subprocess(settings: EngineSettings, load: Load, out: Path) -> dict[str, Any]:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(settings.kv_cache_gib)}
    env.pop("OMP_NUM_THREADS", None)  # vLLM picks its engine process's threads itself, as for any user
    # run as a script, not `-m`: importing the baige_ray package would import torch before the clock starts
    command = [sys.executable, str(Path(__file__).resolve()), "--settings", json.dumps(asdict(settings)),
               "--load", json.dumps(asdict(load)), "--out", str(out)]
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=DIRECT_TIMEOUT_S)
    if completed.returncode != 0:
        raise RuntimeError(f"vllm.LLM run exited with {completed.returncode}\n{completed.stderr[-4000:]}")
    bound = re.search(r"core ids=(\[[0-9, ]*\])", completed.stdout + completed.stderr)
    return {**json.loads(out.read_text()), "omp_cores": json.loads(bound.group(1)) if bound else None}


def direct_run(settings: EngineSettings, load: Load, process_started: float) -> dict[str, Any]:
    """In the subprocess: vllm.LLM on the directory, its load time and tokens/s per level."""
    from vllm import LLM, SamplingParams

    imported = time.perf_counter()
    llm = LLM(model=settings.model, tokenizer=settings.model, dtype=settings.dtype,
              max_model_len=settings.max_model_len, max_num_seqs=settings.max_num_seqs,
              enforce_eager=settings.enforce_eager, enable_prefix_caching=settings.enable_prefix_caching,
              seed=settings.seed, disable_log_stats=True)
    built = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=load.max_tokens, ignore_eos=True)
    first = llm.generate([load.prompt], params, use_tqdm=False)[0]
    answered = time.perf_counter()
    levels = {}
    for streams in load.streams:
        started = time.perf_counter()
        outputs = [output for _ in range(load.requests)
                   for output in llm.generate([load.prompt] * streams, params, use_tqdm=False)]
        elapsed = time.perf_counter() - started
        levels[str(streams)] = _level(elapsed, [len(output.outputs[0].token_ids) for output in outputs],
                                      stopped=sum(output.outputs[0].finish_reason == "stop" for output in outputs))
    return {"load_s": round(answered - process_started, 3), "import_s": round(imported - process_started, 3),
            "engine_s": round(built - imported, 3), "first_generate_s": round(answered - built, 3),
            "prompt_tokens": len(first.prompt_token_ids), "first_completion_tokens": len(first.outputs[0].token_ids),
            "cpus": len(os.sched_getaffinity(0)), "levels": levels}


def main(argv: list[str] | None = None) -> None:
    process_started = time.perf_counter()
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)  # run as a script: this folder's modules (serve.py, ...) must not shadow others
    parser = argparse.ArgumentParser(description="vllm.LLM's load time and tokens/s (bench scale's direct run)")
    parser.add_argument("--settings", required=True, help="EngineSettings as JSON")
    parser.add_argument("--load", required=True, help="Load as JSON")
    parser.add_argument("--out", required=True)
    options = parser.parse_args(argv)
    load_fields = json.loads(options.load)
    load = Load(**{**load_fields, "streams": tuple(load_fields["streams"])})
    result = direct_run(EngineSettings(**json.loads(options.settings)), load, process_started)
    Path(options.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
