"""The Ray Serve deployment that hosts a model (any plug-in that generates text) behind an HTTP JSON API.

Routes (under the application's route prefix):
  POST generate             {"prompt": str, "max_new_tokens": int, "temperature": float, "seed": int,
                             "truncate_prompt_tokens": int}
                            -> {"text": str, "tokens": int, "latency_s": float, "step": int}
  POST v1/completions       OpenAI's completions shapes as vLLM serves them (serving/openai_api.py, routes in
                            serving/openai_routes.py), "stream": true for SSE
  POST v1/chat/completions  OpenAI's chat shapes (serving/openai_chat.py), "stream": true for SSE
  POST tokenize, detokenize vLLM's: {"prompt": str} or {"messages": [...]} -> {"tokens", "count", "max_model_len"};
                            {"tokens": [...]} -> {"prompt": str} (serving/openai_tokenize.py)
  GET  v1/models            the one model served (the application's name), with its root and max_model_len
  GET  v1/models/{id}       that model, or 404
  GET  health               -> {"status": "ok", "step": int, "replica": str, "node_id": str, "devices": [int]}
                            (+ "experts": placement and rows per expert rank, with expert parallelism;
                            503 with "status": "failed" and the "error" once the replica's engine failed)

Callers inside the cluster may also stream a request's token ids through a deployment handle
(`token_stream`), without HTTP.

Every request joins the replica's continuous batch (serving/engine.py) on the engine's thread, so
the event loop keeps accepting, streaming and health-checking while the batch computes. A request
the engine has no room to queue is answered 503 with Retry-After; a malformed one 4xx with a reason;
one whose prompt and max_tokens exceed the model's context 400, unless it asks for the prompt's last
tokens only with `truncate_prompt_tokens` (serving/context_length.py).
The engine is the built-in one or vLLM (`engine="vllm"`, serving/vllm_engine.py). Weights come from
the application's ServingRegistry: the newest version when the replica starts, and any newer one as soon
as it is published (between two load reports the replica waits on the registry's long poll). vLLM takes
new weights in place between two steps, and so does the built-in engine for new weights of the model it
runs (another model gets a new engine built aside, and requests already in the old one finish on the
weights they started with).

A replica generates before it takes requests (its constructor's warm-up, through the engine it will
serve with), so a model the engine cannot run fails the replica's start, and `serve()`, with the
engine's own error. An engine that raises later fails every request it holds with a 500 naming the
error (a stream ends with an error event) and every new one with a 503; `check_health` raises, so
Ray Serve replaces the replica, and the application's registry records a "failure" event.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import ray
import torch
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from baige_ray.api.errors import ServingError
from baige_ray.models.plugin import plugin_for
from baige_ray.ops.metrics import ServingMetrics
from baige_ray.parallel.packed_tensors import state_tensors
from baige_ray.serving.api_key import UNAUTHORIZED, is_authorized
from baige_ray.serving.block_handover import BlockHandoverClient
from baige_ray.serving.causal_lm_generation import Generation, SamplingParams
from baige_ray.serving.context_length import fit_context
from baige_ray.serving.engine import ContinuousBatchingEngine, EngineFull, EngineLimits, TokenEvent, generate_all
from baige_ray.serving.engine_runner import EngineFailed, EngineRunner
from baige_ray.serving.expert_parallel import ExpertParallelServing
from baige_ray.serving.expert_ranks import ExpertRanks
from baige_ray.serving.generators import TextDelta, TextOutput, text_generator
from baige_ray.serving.kv_blocks import BlockHandover, KVCacheConfig, PrefixBlockStore
from baige_ray.serving.ledger import EngineLoad
from baige_ray.serving.lora_adapters import AdapterSet, AdapterSource, adapter_root
from baige_ray.serving.openai_api import CompletionLimits
from baige_ray.serving.openai_responses import error_body
from baige_ray.serving.openai_routes import MODEL_ROUTE, OpenAIRoutes, ReplicaCalls
from baige_ray.serving.prefix_router import ResponseHead, RoutedRequest
from baige_ray.serving.registry import REGISTRY_NAMESPACE, registry_name
from baige_ray.serving.replica_reports import ReplicaSide, report_forever
from baige_ray.serving.request_timing import RequestTiming, timed_events
from baige_ray.serving.requests import (
    GenerateRequest,
    RequestError,
    RequestLimits,
    parse_generate_request,
    read_body,
)
from baige_ray.serving.vllm_adapters import VLLMAdapters, lora_slots
from baige_ray.serving.vllm_engine import build_vllm_engine

REPORT_INTERVAL_S = 0.5
WARMUP_TOKENS = 4
WARMUP_PROMPT = "warm up"
RETRY_AFTER_S = 1
# Serve marks a replica unhealthy after three failed checks in a row: a failed engine is replaced
# about three periods after it failed (Serve's default period is 10 s).
HEALTH_CHECK_PERIOD_S = 1.0
ROUTES = {"generate": "POST", "v1/completions": "POST", "v1/chat/completions": "POST", "v1/models": "GET",
          MODEL_ROUTE: "GET", "tokenize": "POST", "detokenize": "POST", "health": "GET"}

logger = logging.getLogger(__name__)


def replica_device(gpu_ids: list[int]) -> torch.device:
    """Where the built-in engine computes: the replica's GPU where Ray granted a real one (Ray's
    CUDA_VISIBLE_DEVICES then shows it as device 0); the host for CPU replicas and simulated GPUs."""
    return torch.device("cuda", 0) if gpu_ids and torch.cuda.is_available() else torch.device("cpu")


class ModelServer:
    ROLE = "colocated"  # it prefills and decodes; serving/disaggregation.py has the split roles

    async def __init__(self, *, app_name: str, limits: dict, engine_limits: dict, completion_limits: dict | None = None,
                       engine: str = "builtin", expert_parallel: ExpertParallelServing | None = None,
                       expert_actor_options: dict | None = None, kv_cache: dict | None = None,
                       handover_via: str | None = None, api_key_digest: str | None = None,
                       adapters: dict[str, AdapterSource] | None = None, tool_call_parser: str | None = None,
                       vllm_engine_core: str = "process"):
        torch.set_num_threads(1)  # replicas share few cores with training workers
        self._api_key_digest = api_key_digest  # serving/api_key.py: None when no key is asked
        self._limits = RequestLimits(**limits)
        self._engine_limits = EngineLimits(**engine_limits)
        self._kv_cache = KVCacheConfig(**kv_cache) if kv_cache else None
        self._app_name = app_name
        self._adapters = dict(adapters or {})  # LoRA adapters served beside the model: name -> where from
        calls = ReplicaCalls(require_runner=self._require_runner, complete=self._complete, text=self._text,
                             account=self._account, account_failure=self._account_failure,
                             count_ongoing=self._count_ongoing)
        self._openai = OpenAIRoutes(calls, app_name=app_name, engine_name=engine,
                                    limits=CompletionLimits(**(completion_limits or {})),
                                    adapters={name: adapter_root(source) for name, source in self._adapters.items()},
                                    tool_call_parser=tool_call_parser)
        self._registry = ray.get_actor(registry_name(app_name), namespace=REGISTRY_NAMESPACE)
        context = serve.get_replica_context()
        self._replica = context.replica_id.unique_id
        self._handover = BlockHandoverClient(app_name=app_name, replica=self._replica, via=handover_via)
        self._rank = getattr(context.rank, "rank", context.rank)  # the replica's rank in its deployment (events)
        self._node = ray.get_runtime_context().get_node_id()
        self._devices = [int(index) for index in ray.get_gpu_ids()]  # the (possibly shared) devices it holds
        self._compute_device = replica_device(self._devices)
        self._metrics = ServingMetrics(app=app_name)
        self._engine_name = engine
        self._vllm_engine_core = vllm_engine_core  # where vLLM's engine core runs (vllm_engine.ENGINE_CORE_PLACES)
        self._expert_parallel, self._expert_actor_options = expert_parallel, expert_actor_options or {}
        self._expert_ranks: ExpertRanks | None = None  # with expert_parallel: the ranks holding the experts
        self._model = None  # the built-in engine's model, which expert-parallel replicas update in place
        self._runner: EngineRunner | None = None
        self._model_config = None
        self._version, self._step = 0, -1
        self._weights_version = -1  # the registry's version at which the weights it holds were published
        self._asleep = False  # its engine gave its device memory back while training uses the device
        self._ongoing = 0
        self._pending_latencies: list[float] = []
        self._reporter: asyncio.Task | None = None
        await self._load_newest_weights()
        self._ensure_reporter()

    async def _load_newest_weights(self) -> None:
        version, step, model_config, (state_ref,), weights_version, adapters = await self._registry.weights.remote()
        if version == self._version:
            return
        if weights_version == self._weights_version and self._runner is not None:
            await self._swap_adapters(adapters)  # the weights it holds, with a newer adapter beside them
            self._version = version
            return
        if self._asleep:  # weights are published to be served: awake first, so they land on the device
            await self._turn(False)
        published = await state_ref  # a dict of tensors, or PackedTensors whose arrays lie in the object store
        builtin_in_place = (self._engine_name != "vllm" and self._runner is not None and self._expert_ranks is None
                            and model_config == self._model_config)
        # Private copies, for anything else: off the event loop (2 GB took seconds; reports must go on).
        state = None if builtin_in_place else await asyncio.to_thread(state_tensors, published)
        if self._engine_name == "vllm" and self._runner is not None and model_config == self._model_config:
            # vLLM takes new weights in place, between two steps: running requests go on, no restart.
            engine = self._runner.engine
            await self._runner.between_steps(lambda: engine.load_weights(state))
        elif builtin_in_place:
            # The same model on the built-in engine: its weights copied in place between two steps (no model
            # built: an RL policy's replicas take new weights every iteration), as with vLLM.
            engine, prefixes = self._runner.engine, self._prefix_store(plugin_for(model_config), version)
            views = state_tensors(published, copy=False)  # only read, by the copy into the model
            await self._runner.between_steps(lambda: engine.load_weights(views, prefixes))
        elif self._expert_ranks is not None and model_config == self._model_config:
            # The expert ranks hold this model's experts: new weights go to them in place, between two
            # steps (running requests go on with the new weights, as with vLLM).
            await self._runner.between_steps(lambda: self._load_in_place(model_config, state))
        elif self._expert_ranks is not None:
            # Another model: its experts need ranks of their own, after the old engine has drained.
            previous, self._runner = self._runner, None  # requests meanwhile get 503 and retry
            previous.retire()
            await asyncio.to_thread(previous.join)
            await asyncio.to_thread(self._expert_ranks.close)
            self._expert_ranks = None
            self._runner = self._watch_engine(await asyncio.to_thread(self._build_runner, model_config, state,
                                                                      first=True, version=version))
        else:
            runner = await asyncio.to_thread(self._build_runner, model_config, state, first=self._runner is None,
                                             version=version)
            previous, self._runner = self._runner, self._watch_engine(runner)
            if previous is not None:
                previous.retire()  # requests already in it finish on the weights they started with
        await self._swap_adapters(adapters)  # any replaced with the weights, in whichever engine now serves
        self._version, self._step, self._model_config = version, step, model_config
        self._weights_version = weights_version
        self._openai.learn_model(model_config, self._runner.engine.max_context)

    async def _swap_adapters(self, adapters: dict[str, AdapterSource]) -> None:
        """Each adapter whose source changed read (off the event loop), then put in its slot between two
        engine steps: rows of a running request use the new matrices from the next token on."""
        changed = {name: source for name, source in adapters.items() if self._adapters.get(name) != source}
        if not changed:
            return
        served = self._runner.engine.adapters  # AdapterSet (built-in engine) or VLLMAdapters
        loaded = {name: await asyncio.to_thread(served.prepare, name, source) for name, source in changed.items()}

        def swap() -> None:
            for name, weights in loaded.items():
                served.add(name, weights)

        await self._runner.between_steps(swap)
        self._adapters.update(changed)
        self._openai.adapters.update({name: adapter_root(source) for name, source in changed.items()})

    def _build_runner(self, model_config, state: dict, *, first: bool, version: int) -> EngineRunner:
        plugin = plugin_for(model_config)
        if self._engine_name == "vllm":
            engine, codec = build_vllm_engine(plugin, state, self._engine_limits, adapters=self._vllm_adapters(),
                                              engine_core=self._vllm_engine_core)
            with _engine_cannot_run(plugin.describe(), "vllm"):  # one token through vLLM itself
                generate_all(engine, [codec.encode(WARMUP_PROMPT)], [SamplingParams(max_new_tokens=1, temperature=0.0)])
            return EngineRunner(engine, codec)
        generator = text_generator(plugin, state)
        generator.decoder.model.to(self._compute_device)
        if self._expert_parallel is not None:
            self._model = generator.decoder.model
            self._expert_ranks = ExpertRanks(plugin.inference_expert_layers(self._model), self._expert_parallel,
                                             self._expert_actor_options)
        # A full batch before any request sees the model: a fresh process's first batch took 4x a warm
        # one (0.107 s against 0.025 s measured), and the router sends a new, empty replica many requests at once.
        # Later models get one token: enough to refuse one the engine cannot run.
        size, tokens = (self._engine_limits.max_batch_size, WARMUP_TOKENS) if first else (1, 1)
        with _engine_cannot_run(plugin.describe(), "builtin"):
            generator.generate([GenerateRequest(prompt=WARMUP_PROMPT, max_new_tokens=tokens, temperature=1.0,
                                                seed=0)] * size)
        engine = ContinuousBatchingEngine(generator.decoder, eos_token_id=generator.codec.eos_token_id,
                                          limits=self._engine_limits, prefixes=self._prefix_store(plugin, version),
                                          adapters=self._adapter_set(generator.decoder.model))
        return EngineRunner(engine, generator.codec)

    def _adapter_set(self, model) -> AdapterSet | None:
        """The LoRA adapters this replica serves, applied per request over `model` (None: none served)."""
        return self._served_adapters(AdapterSet(model)) if self._adapters else None

    def _vllm_adapters(self) -> VLLMAdapters | None:
        """The LoRA adapters this replica serves through vLLM's multi-LoRA (None: none served)."""
        return self._served_adapters(VLLMAdapters(lora_slots(self._adapters))) if self._adapters else None

    def _served_adapters(self, served):
        for name, source in self._adapters.items():
            served.add(name, served.prepare(name, source))
        return served

    def _prefix_store(self, plugin, version: int) -> PrefixBlockStore | None:
        """This replica's prefix cache for one weights version (blocks of other weights would be wrong)."""
        if self._kv_cache is None or not self._kv_cache.enabled:
            return None
        config = self._kv_cache
        if config.disk_dir:  # files of its own: the store's index of them lives in this process
            config = dataclasses.replace(config, disk_dir=str(Path(config.disk_dir) / f"{self._app_name}-{self._replica}"))
        return PrefixBlockStore(config, self._compute_device, namespace=f"{plugin.describe()}@v{version}")

    # -- prefix blocks handed over when the replica stops ---------------------------------------
    async def __del__(self) -> None:
        """Serve calls this once a stopping replica has drained: its hottest prefix blocks go to a peer
        (serving/block_handover.py)."""
        store = self._prefix_store_in_use()
        if store is not None:
            await self._handover.hand_over(store, self._runner, self._registry)

    async def adopt_blocks(self, handover: BlockHandover) -> int:
        """Keep a stopping peer's prefix blocks (on the same weights; else none); how many were kept."""
        store = self._prefix_store_in_use()
        if store is None:
            return 0
        return await self._runner.between_steps(lambda: store.adopt(handover))

    def _prefix_store_in_use(self) -> PrefixBlockStore | None:
        engine = self._runner.engine if self._runner is not None else None
        return engine.prefixes if isinstance(engine, ContinuousBatchingEngine) else None

    # -- engine failures -----------------------------------------------------------------------
    def _watch_engine(self, runner: EngineRunner) -> EngineRunner:
        """`runner`, whose failure will be logged and recorded in the registry's event log."""
        loop = asyncio.get_running_loop()

        def failed(reason: str) -> None:  # on the engine's thread
            with contextlib.suppress(RuntimeError):  # the replica's loop is closing
                loop.call_soon_threadsafe(self._engine_failed, reason)

        runner.after_failure(failed)
        return runner

    def _engine_failed(self, reason: str) -> None:
        logger.error("replica %s of %s: the engine failed (%s); requests get 5xx until Serve replaces the replica",
                     self._replica, self._app_name, reason)
        self._registry.record_event.remote(
            "failure", f"the replica's engine failed: {reason}", rank=self._rank, node_id=self._node,
            replica=self._replica, app=self._app_name, role=self.ROLE, engine=self._engine_name,
        )

    def check_health(self) -> None:
        """Ray Serve's health check (every HEALTH_CHECK_PERIOD_S): raises once the engine has failed, so that
        Serve stops this replica and starts another."""
        if self._runner is not None:
            self._runner.check()

    def _load_in_place(self, model_config, state: dict) -> None:
        fresh = plugin_for(model_config).build_inference_model(state)  # checks the names and shapes
        self._model.load_state_dict(fresh.state_dict())
        self._expert_ranks.dispatcher.reload_weights()

    # -- routing -------------------------------------------------------------------------------
    async def __call__(self, request: Request) -> Response:
        self._ensure_reporter()
        route = self._route(request)
        key = MODEL_ROUTE if route.startswith("v1/models/") else route
        openai = key not in ("generate", "health")
        if self._api_key_digest is not None and key != "health" and not is_authorized(
                request.headers.get("authorization"), self._api_key_digest):
            return JSONResponse(UNAUTHORIZED, status_code=401)
        if key not in ROUTES:
            expected = ", ".join(f"{method} {path}" for path, method in ROUTES.items())
            return _error(404, f"no route {route!r}: expected one of {expected}", openai=route.startswith("v1/"))
        if request.method != ROUTES[key]:
            return _error(405, f"{request.method} is not allowed on {route}: use {ROUTES[key]}", openai=openai)
        if key == "health":
            return self._health()
        if key in ("v1/models", MODEL_ROUTE):
            try:
                return self._openai.models(route)
            except RequestError as error:
                return _error(error.status, error.reason, openai=True, param=error.param)
        handler = {"generate": self._handle_generate, "v1/completions": self._openai.completion,
                   "v1/chat/completions": self._openai.chat, "tokenize": self._openai.tokenize,
                   "detokenize": self._openai.detokenize}[key]
        started = time.perf_counter()
        try:
            return await handler(request, started)
        except RequestError as error:
            self._account_failure(started)
            return _error(error.status, error.reason, openai=openai, param=error.param)
        except EngineFull as error:
            self._account_failure(started)
            return _error(503, f"the replica is overloaded ({error}); retry after {RETRY_AFTER_S} s",
                          openai=openai, headers={"Retry-After": str(RETRY_AFTER_S)})
        except EngineFailed as error:
            self._account_failure(started)
            if error.accepted:  # it was being generated: a server error
                return _error(500, str(error), openai=openai)
            # It arrived after the failure: another replica (Serve starts one) can answer it.
            return _error(503, f"{error}; retry after {RETRY_AFTER_S} s", openai=openai,
                          headers={"Retry-After": str(RETRY_AFTER_S)})

    async def routed(self, request: RoutedRequest) -> AsyncIterator[ResponseHead | bytes]:
        """The answer to an HTTP request a prefix-routing ingress forwarded (serving/prefix_router.py), as
        `__call__` gives it: its head, then its body (server-sent events chunk by chunk)."""

        async def receive() -> dict:
            return {"type": "http.request", "body": request.body, "more_body": False}

        response = await self(Request(request.scope, receive))
        streamed = isinstance(response, StreamingResponse)
        yield ResponseHead(status=response.status_code, headers=list(response.raw_headers), streamed=streamed)
        if not streamed:
            yield response.body
            return
        try:
            async for chunk in response.body_iterator:
                yield chunk if isinstance(chunk, bytes) else chunk.encode()
        finally:
            await response.body_iterator.aclose()  # a client gone mid-stream: its request leaves the batch

    def _health(self) -> JSONResponse:
        health = {"status": "ok", "step": self._step, "replica": self._replica, "node_id": self._node,
                  "devices": self._devices, "compute_device": str(self._compute_device)}
        if self._expert_ranks is not None:
            health["experts"] = self._expert_ranks.stats()
        if (prefix_cache := self._prefix_cache_report()) is not None:
            health["prefix_cache"] = prefix_cache
        try:
            self.check_health()
        except EngineFailed as error:  # 503 until Serve replaces the replica
            return JSONResponse({**health, "status": "failed", "error": str(error)}, status_code=503)
        return JSONResponse(health)

    @staticmethod
    def _route(request: Request) -> str:
        path = request.url.path
        root = request.scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        return path.strip("/")

    # -- handlers ------------------------------------------------------------------------------
    async def _handle_generate(self, request: Request, started: float) -> Response:
        parsed = parse_generate_request(await read_body(request, self._limits.max_body_bytes), self._limits)
        runner, step = self._require_runner(), self._step
        prompt = fit_context(runner.codec.encode(parsed.prompt), max_tokens=parsed.max_new_tokens,
                             max_context=runner.engine.max_context, limit=runner.engine.context_limit,
                             truncate_prompt_tokens=parsed.truncate_prompt_tokens, field="max_new_tokens")
        params = SamplingParams(max_new_tokens=parsed.max_new_tokens, temperature=parsed.temperature,
                                seed=parsed.seed)
        output = await self._complete(runner, prompt, params)
        return JSONResponse({"text": output.text, "tokens": output.completion_tokens,
                             "latency_s": self._account(started), "step": step})

    async def _complete(self, runner: EngineRunner, prompt: list[int], params: SamplingParams) -> TextOutput:
        self._ongoing += 1
        try:
            async with contextlib.aclosing(self._text(runner, prompt, params)) as pieces:  # closing cancels it
                async for piece in pieces:
                    if isinstance(piece, TextOutput):
                        return piece
            raise RuntimeError("the engine ended a request without its output")
        finally:
            self._ongoing -= 1

    async def _text(self, runner: EngineRunner, prompt: list[int],
                    params: SamplingParams) -> AsyncIterator[TextDelta | TextOutput]:
        """Text deltas, cut at the request's stop strings; last, the whole TextOutput. Its tokens' timing
        and counts go to the metrics, however it ends."""
        timing = RequestTiming(submitted=time.perf_counter())
        pieces = runner.text(prompt, params, events=timed_events(self._events(runner, prompt, params), timing))
        try:
            async for piece in pieces:
                yield piece
        finally:
            await pieces.aclose()
            self._metrics.tokens(prompt_tokens=len(prompt), generated_tokens=timing.tokens,
                                 time_to_first_token_s=timing.time_to_first_token_s,
                                 time_per_output_token_s=timing.time_per_output_token_s,
                                 replica=self._replica, node=self._node)

    def _events(self, runner: EngineRunner, prompt: list[int], params: SamplingParams) -> AsyncIterator[TokenEvent]:
        """The request's token events (a decode replica overrides where they come from); closing it cancels it."""
        return runner.tokens(prompt, params)

    async def token_stream(self, prompt: list[int], params: SamplingParams) -> AsyncIterator[int]:
        """The request's token ids as they are sampled, for callers in the cluster (a deployment handle
        with stream=True: other deployments, benchmarks); no HTTP, no text."""
        runner = self._require_runner()
        self._ongoing += 1
        try:
            async with contextlib.aclosing(self._events(runner, prompt, params)) as events:
                async for event in events:
                    if event.token is not None:
                        yield event.token
        finally:
            self._ongoing -= 1

    async def token_completions(self, groups: list[tuple[list[int], list[SamplingParams]]]
                                ) -> AsyncIterator[int | list[list[Generation]]]:
        """For each (prompt, params) group (an RL group: one completion of the prompt per entry of params),
        its completions, all decoded in one batch, for callers in the cluster (a deployment handle with
        stream=True): yields this replica's process id once the first token is sampled (who is busy, for a
        fault injector to pick), then every group's completions at once (tokens, why each ended, the
        log-probabilities asked for): two messages where `token_stream` sends one per token and request."""
        runner = self._require_runner()
        requests = [(prompt, one) for prompt, params in groups for one in params]
        self._ongoing += len(requests)
        sampling = asyncio.Event()

        async def completion(prompt: list[int], one: SamplingParams) -> Generation:
            async with contextlib.aclosing(self._events(runner, prompt, one)) as events:
                tokens, log_probs, reason = [], [], "length"
                async for event in events:
                    if event.token is not None:
                        tokens.append(event.token)
                        sampling.set()
                    else:
                        reason = event.finish_reason or reason
                    if event.log_prob is not None:
                        log_probs.append(event.log_prob)
                return Generation(tokens=tokens, finish_reason=reason, log_probs=log_probs if one.log_probs else None)

        everything = asyncio.ensure_future(asyncio.gather(*(completion(prompt, one) for prompt, one in requests)))
        try:
            first = asyncio.ensure_future(sampling.wait())
            await asyncio.wait([first, everything], return_when=asyncio.FIRST_COMPLETED)
            first.cancel()
            yield os.getpid()
            flat = iter(await everything)
            yield [[next(flat) for _ in params] for _, params in groups]
        finally:
            everything.cancel()
            self._ongoing -= len(requests)

    def _count_ongoing(self, change: int) -> None:
        self._ongoing += change

    def _require_runner(self) -> EngineRunner:
        if self._runner is None:
            raise EngineFull("the model is still loading")
        return self._runner

    def _account(self, started: float) -> float:
        latency = time.perf_counter() - started
        self._pending_latencies.append(latency)
        self._metrics.request(latency_s=latency, replica=self._replica, node=self._node)
        return latency

    def _account_failure(self, started: float) -> None:
        self._metrics.request(latency_s=time.perf_counter() - started, ok=False, replica=self._replica, node=self._node)

    # -- reports to the registry ---------------------------------------------------------------
    def _ensure_reporter(self) -> None:
        if self._reporter is None or self._reporter.done():
            self._reporter = asyncio.get_running_loop().create_task(self._report_forever())

    async def _report_forever(self) -> None:
        side = ReplicaSide(report_fields=self._report_fields, state=lambda: (self._version, self._asleep),
                           load_newest_weights=self._load_newest_weights, turn=self._turn)
        await report_forever(self._registry, self._replica, side, REPORT_INTERVAL_S)

    def _report_fields(self) -> dict:
        latencies, self._pending_latencies = self._pending_latencies, []
        busy_s = 0.0
        if self._runner is not None:
            busy_s, self._runner.busy_s = self._runner.busy_s, 0.0
        self._metrics.queue_depth(self._ongoing, replica=self._replica)
        load, prefix_cache = self._engine_load(), self._prefix_cache_report()
        if load is not None:
            self._metrics.engine_requests(running=load.num_running, waiting=load.num_waiting, replica=self._replica)
        if prefix_cache is not None:
            self._metrics.kv_blocks(prefix_cache["blocks"], replica=self._replica)
        return dict(latencies=latencies, busy_s=busy_s, ongoing=self._ongoing, loaded_version=self._version,
                    device=(self._node, self._devices[0]) if self._devices else None, engine=load,
                    prefix_cache=prefix_cache, asleep=self._asleep)

    async def _turn(self, asleep: bool) -> None:
        """Give back the device memory the engine holds between requests, or take it again (serving/
        device_memory.py): training uses the device meanwhile. The built-in engine only: others stay."""
        engine = self._runner.engine if self._runner is not None else None
        if not isinstance(engine, ContinuousBatchingEngine):
            self._asleep = asleep  # nothing it can give back: it says it did, so training is not held up
            return
        started = time.perf_counter()
        try:
            released = await self._runner.between_steps(engine.sleep if asleep else engine.wake)
        except RuntimeError as error:  # requests still running: it stays awake, and the caller learns who
            logger.warning("replica %s cannot sleep: %s", self._replica, error)
            return
        self._asleep = asleep
        self._registry.record_event.remote("engine_asleep" if asleep else "engine_awake", "colocated with training",
                                           replica=self._replica, released_bytes=released or 0,
                                           seconds=round(time.perf_counter() - started, 4))

    def _prefix_cache_report(self) -> dict | None:
        store = self._prefix_store_in_use()
        return None if store is None else store.report()

    def _engine_load(self) -> EngineLoad | None:
        engine = self._runner.engine if self._runner is not None else None
        return None if engine is None else EngineLoad(self.ROLE, engine.num_waiting, engine.num_running)


@contextlib.contextmanager
def _engine_cannot_run(model: str, engine: str):
    """A warm-up generation that raises becomes a ServingError naming the model, the engine and its error."""
    try:
        yield
    except Exception as error:
        raise ServingError(f"engine={engine!r} cannot run {model}: generating one token raised "
                           f"{type(error).__name__}: {error}") from error


def _error(status: int, reason: str, *, openai: bool, headers: dict | None = None,
           param: str | None = None) -> JSONResponse:
    body = error_body(status, reason, param) if openai else {"error": reason}
    return JSONResponse(body, status_code=status, headers=headers)
