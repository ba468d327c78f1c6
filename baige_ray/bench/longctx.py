"""Long context: short requests' time to first token while long prompts prefill, chunked and whole.

Serving (issue #78): one built-in engine (`ContinuousBatchingEngine`) in this process, a Llama-architecture
model built from its config with `transformers`. Requests arrive on a fixed, seeded schedule (open loop):
short ones (a few dozen prompt tokens) every `--short-interval-s`, and long prompts (`--long-tokens`) every
`--long-interval-s`. Prefilled whole, a long prompt holds an engine step for its whole forward, and every
short request arriving meanwhile waits for it; with `max_num_batched_tokens` (serving/chunked_prefill.py)
each step runs a chunk of it and the short ones go through between chunks. Reported per mode: TTFT p50 /
p99 of the short requests (arrival to first token) and of the long ones, generated tokens/s; the greedy
answers of both modes must be equal. `chunked_short_ttft_p99_speedup` = whole p99 / chunked p99.

Training (bench/longctx_training.py): context parallelism on gloo ranks of this machine, the longest
sequence under a fixed memory cap at CP1, CP2 and CP4 (ring and Ulysses), the planner's memory model
against what autograd keeps, step time at equal tokens and bytes sent per layer against the formula.
`--part serving` or `--part training` runs one half.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from baige_ray.bench.measure import report_stage

# Grouped-query attention as served models have it; a 2,048-token prefill takes about 2 s on the CPU machine.
MODEL_SHAPE = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 6, "num_attention_heads": 8,
               "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 4096}
QUICK_SHAPE = {**MODEL_SHAPE, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
               "max_position_embeddings": 1024}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--long-tokens", type=int, default=2048, help="prompt tokens of each long request")
    parser.add_argument("--short-tokens", type=int, default=32, help="prompt tokens of each short request")
    parser.add_argument("--answer-tokens", type=int, default=8, help="new tokens per request (greedy)")
    parser.add_argument("--short-interval-s", type=float, default=0.25)
    parser.add_argument("--long-interval-s", type=float, default=6.0)
    parser.add_argument("--duration-s", type=float, default=30.0, help="how long requests keep arriving")
    parser.add_argument("--max-num-batched-tokens", type=int, default=128, help="the chunked run's step budget")
    parser.add_argument("--cap-tokens", type=int, default=2048,
                        help="training: the memory cap is what one rank keeps at this length without CP")
    parser.add_argument("--step-tokens", type=int, default=2048, help="training: sequence length of the timed steps")
    parser.add_argument("--part", choices=("both", "serving", "training"), default="both")
    parser.add_argument("--quick", action="store_true", help="a small model and a few seconds (tests)")


@dataclass(frozen=True)
class Arrival:
    at_s: float
    prompt: tuple[int, ...]
    long: bool


def schedule(*, seed: int, duration_s: float, short_interval_s: float, long_interval_s: float, short_tokens: int,
             long_tokens: int, vocab: int) -> list[Arrival]:
    """Short requests every `short_interval_s` and long ones every `long_interval_s` (the first at half
    an interval), random tokens, in arrival order."""
    rng = np.random.default_rng(seed)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(int(t) for t in rng.integers(0, vocab, n))

    arrivals = [Arrival(at, tokens(short_tokens), False) for at in np.arange(0.0, duration_s, short_interval_s)]
    arrivals += [Arrival(at, tokens(long_tokens), True)
                 for at in np.arange(long_interval_s / 2, duration_s, long_interval_s)]
    return sorted(arrivals, key=lambda arrival: arrival.at_s)


@dataclass
class ModeResult:
    short_ttft_s: list[float] = field(default_factory=list)
    long_ttft_s: list[float] = field(default_factory=list)
    answers: dict[int, list[int]] = field(default_factory=dict)  # arrival index -> greedy tokens
    generated: int = 0
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        def percentiles(values: list[float]) -> dict[str, float]:
            return {"p50_s": float(np.percentile(values, 50)), "p99_s": float(np.percentile(values, 99))}

        return {"short_requests": len(self.short_ttft_s), "long_requests": len(self.long_ttft_s),
                "short_ttft": percentiles(self.short_ttft_s), "long_ttft": percentiles(self.long_ttft_s),
                "tokens_per_s": self.generated / self.seconds, "seconds": self.seconds}


def run_mode(model, arrivals: list[Arrival], *, answer_tokens: int, max_context: int,
             max_num_batched_tokens: int | None) -> ModeResult:
    """Every arrival through one engine stepped on this thread, each submitted once its time has come."""
    from baige_ray.models.hf.decoding import HFDecoder
    from baige_ray.serving.causal_lm_generation import SamplingParams
    from baige_ray.serving.engine import ContinuousBatchingEngine, EngineLimits

    batch = 16
    engine = ContinuousBatchingEngine(HFDecoder(model, max_context), eos_token_id=None,
                                      limits=EngineLimits(max_batch_size=batch, max_waiting=len(arrivals),
                                                          max_num_batched_tokens=max_num_batched_tokens))
    result, params = ModeResult(), SamplingParams(max_new_tokens=answer_tokens, temperature=0.0)
    start = time.perf_counter()

    def sink(index: int, arrival: Arrival):
        def on_event(event) -> None:
            if event.token is None:
                return
            tokens = result.answers.setdefault(index, [])
            if not tokens:
                (result.long_ttft_s if arrival.long else result.short_ttft_s).append(
                    time.perf_counter() - start - arrival.at_s)
            tokens.append(event.token)
            result.generated += 1
        return on_event

    pending = list(enumerate(arrivals))
    while pending or engine.num_running or engine.num_waiting:
        now = time.perf_counter() - start
        while pending and pending[0][1].at_s <= now:
            index, arrival = pending.pop(0)
            engine.submit(list(arrival.prompt), params, sink(index, arrival))
        if not engine.step() and pending:
            time.sleep(max(0.0, min(0.01, pending[0][1].at_s - now)))
    result.seconds = time.perf_counter() - start
    return result


def _model(shape: dict):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=torch.float32).eval()


def run(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {}
    if args.part in ("both", "training"):
        from baige_ray.bench import longctx_training

        report_stage(args, "training with context parallelism", 0, 4)
        training = longctx_training.run(args)
        result.update({key: training.pop(key) for key in ("max_seq_cp4_vs_cp1", "sp_memory_error", "cp_memory_error")})
        result["training"] = training
    if args.part in ("both", "serving"):
        serving = run_serving(args)
        result["chunked_short_ttft_p99_speedup"] = serving.pop("chunked_short_ttft_p99_speedup")
        result.update(serving)
    return result


def run_serving(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(2)
    shape = QUICK_SHAPE if args.quick else MODEL_SHAPE
    long_tokens = min(args.long_tokens, shape["max_position_embeddings"] - args.answer_tokens)
    duration_s = min(args.duration_s, 4.0) if args.quick else args.duration_s
    model = _model(shape)
    arrivals = schedule(seed=0, duration_s=duration_s, short_interval_s=args.short_interval_s,
                        long_interval_s=args.long_interval_s, short_tokens=args.short_tokens,
                        long_tokens=long_tokens, vocab=shape["vocab_size"])
    context = shape["max_position_embeddings"]
    report_stage(args, "warm-up", 1, 4)
    run_mode(model, arrivals[:3], answer_tokens=2, max_context=context, max_num_batched_tokens=None)
    report_stage(args, "long prompts prefilled whole", 2, 4)
    whole = run_mode(model, arrivals, answer_tokens=args.answer_tokens, max_context=context,
                     max_num_batched_tokens=None)
    report_stage(args, f"long prompts in chunks of {args.max_num_batched_tokens} tokens", 3, 4)
    chunked = run_mode(model, arrivals, answer_tokens=args.answer_tokens, max_context=context,
                       max_num_batched_tokens=args.max_num_batched_tokens)
    whole_p99, chunked_p99 = (np.percentile(r.short_ttft_s, 99) for r in (whole, chunked))
    return {
        "chunked_short_ttft_p99_speedup": float(whole_p99 / chunked_p99),
        "tokens_equal": whole.answers == chunked.answers,
        "serving": {"whole": whole.summary(), "chunked": chunked.summary()},
        "workload": {"long_tokens": long_tokens, "short_tokens": args.short_tokens,
                     "answer_tokens": args.answer_tokens, "short_interval_s": args.short_interval_s,
                     "long_interval_s": args.long_interval_s, "duration_s": duration_s,
                     "max_num_batched_tokens": args.max_num_batched_tokens, "model": shape},
    }


def summarize(result: dict[str, Any]) -> str:
    lines = []
    if "training" in result:
        longest = result["training"]["longest_sequence"]
        lines.append(f"longest sequence under one memory cap: CP1 {longest['cp=1']}, CP2 {longest['cp=2']}, CP4 "
                     f"{longest['cp=4']} tokens ({result['max_seq_cp4_vs_cp1']:.2f}x); planner memory error: CP "
                     f"{result['cp_memory_error']:.3f}, SP {result['sp_memory_error']:.3f}")
    if "serving" in result:
        whole, chunked = result["serving"]["whole"], result["serving"]["chunked"]
        lines.append(
            f"short requests' TTFT p99: {whole['short_ttft']['p99_s']:.3f} s whole, "
            f"{chunked['short_ttft']['p99_s']:.3f} s chunked ({result['chunked_short_ttft_p99_speedup']:.1f}x); "
            f"long prompts' TTFT p50: {whole['long_ttft']['p50_s']:.3f} s whole, "
            f"{chunked['long_ttft']['p50_s']:.3f} s chunked; tokens equal: {result['tokens_equal']}")
    return "\n".join(lines)
