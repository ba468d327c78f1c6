"""The Ray Serve deployment that hosts a model (any plug-in that generates text) behind an HTTP JSON API.

Routes (under the application's route prefix):
  POST generate        {"prompt": str, "max_new_tokens": int, "temperature": float, "seed": int}
                       -> {"text": str, "tokens": int, "latency_s": float, "step": int}
  POST v1/completions  OpenAI's completions request and response shapes (serving/openai_api.py)
  GET  health          -> {"status": "ok", "step": int, "replica": str, "node_id": str, "devices": [int]}

Requests are batched by `@serve.batch`; the forward passes run on a worker thread so the replica's
event loop keeps accepting, queueing and health-checking while a batch computes. Weights come from
the application's ServingRegistry: the newest version when the replica starts, and any newer one the
registry names in answer to the replica's periodic report. A new model is built aside and replaces
the old one in one assignment, so a batch in flight finishes on the weights it started with.
The model's plug-in turns canonical weights into a `TextGenerator` (tokenizer, KV cache), so the
server knows nothing of model families.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import ray
import torch
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse

from baige_ray.models.plugin import plugin_for
from baige_ray.ops.metrics import ServingMetrics
from baige_ray.serving.generators import TextGenerator, TextOutput
from baige_ray.serving.openai_api import (
    CompletionLimits, apply_stop, completion_response, error_body, parse_completion_request,
)
from baige_ray.serving.registry import REGISTRY_NAMESPACE, registry_name
from baige_ray.serving.requests import GenerateRequest, RequestError, RequestLimits, parse_generate_request

REPORT_INTERVAL_S = 0.5
WARMUP_TOKENS = 4


def _error(status: int, reason: str) -> JSONResponse:
    return JSONResponse({"error": reason}, status_code=status)


class ModelServer:
    async def __init__(self, *, app_name: str, limits: dict, max_batch_size: int, batch_wait_timeout_s: float,
                       completion_limits: dict | None = None):
        torch.set_num_threads(1)  # replicas share few cores with training workers
        self._limits = RequestLimits(**limits)
        self._completion_limits = CompletionLimits(**(completion_limits or {}))
        self._app_name = app_name
        self._registry = ray.get_actor(registry_name(app_name), namespace=REGISTRY_NAMESPACE)
        self._replica = serve.get_replica_context().replica_id.unique_id
        self._node = ray.get_runtime_context().get_node_id()
        self._devices = [int(index) for index in ray.get_gpu_ids()]  # the (possibly shared) devices it holds
        self._metrics = ServingMetrics(app=app_name)
        self._generator: TextGenerator | None = None
        self._model_name = app_name
        self._version, self._step = 0, -1
        self._ongoing = 0
        self._pending_latencies: list[float] = []
        self._pending_busy_s = 0.0
        self._reporter: asyncio.Task | None = None
        self._warmup_size = max_batch_size
        self._generate_batch.set_max_batch_size(max_batch_size)
        self._generate_batch.set_batch_wait_timeout_s(batch_wait_timeout_s)
        await self._load_newest_weights()
        self._ensure_reporter()

    async def _load_newest_weights(self) -> None:
        version, step, model_config, (state_ref,) = await self._registry.weights.remote()
        if version == self._version:
            return
        state = await state_ref
        warmup_size = self._warmup_size if self._generator is None else 0  # a swap runs in an already warm process
        generator = await asyncio.to_thread(self._build_generator, model_config, state, warmup_size)
        self._generator, self._version, self._step = generator, version, step

    @staticmethod
    def _build_generator(model_config, state: dict, warmup_size: int) -> TextGenerator:
        generator = plugin_for(model_config).build_text_generator(state)
        # A full batch before any request sees the model: a fresh process's first batch took 4x a warm
        # one (0.107 s against 0.025 s measured), and the router sends a new, empty replica many requests at once.
        if warmup_size:
            warmup = GenerateRequest(prompt="warm up", max_new_tokens=WARMUP_TOKENS, temperature=1.0, seed=0)
            generator.generate([warmup] * warmup_size)
        return generator

    async def __call__(self, request: Request) -> JSONResponse:
        self._ensure_reporter()
        route = self._route(request)
        if route == "health":
            if request.method != "GET":
                return _error(405, f"{request.method} is not allowed on health: use GET")
            return JSONResponse({"status": "ok", "step": self._step, "replica": self._replica,
                                 "node_id": self._node, "devices": self._devices})
        if route == "generate":
            if request.method != "POST":
                return _error(405, f"{request.method} is not allowed on generate: use POST")
            return await self._handle_generate(request)
        if route == "v1/completions":
            if request.method != "POST":
                return JSONResponse(error_body(405, f"{request.method} is not allowed: use POST"), status_code=405)
            return await self._handle_completion(request)
        return _error(404, f"no route {route!r}: expected 'generate' or 'v1/completions' (POST), or 'health' (GET)")

    @staticmethod
    def _route(request: Request) -> str:
        path = request.url.path
        root = request.scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        return path.strip("/")

    async def _handle_generate(self, request: Request) -> JSONResponse:
        started = time.perf_counter()
        try:
            parsed = parse_generate_request(await request.body(), self._limits)
        except RequestError as error:
            self._metrics.request(latency_s=time.perf_counter() - started, ok=False, replica=self._replica, node=self._node)
            return _error(error.status, error.reason)
        output, step = await self._generate_one(parsed)
        latency = self._account(started)
        return JSONResponse({"text": output.text, "tokens": output.completion_tokens, "latency_s": latency,
                             "step": step})

    async def _handle_completion(self, request: Request) -> JSONResponse:
        started = time.perf_counter()
        try:
            parsed = parse_completion_request(await request.body(), self._completion_limits,
                                              model_name=self._model_name)
        except RequestError as error:
            self._metrics.request(latency_s=time.perf_counter() - started, ok=False, replica=self._replica, node=self._node)
            return JSONResponse(error_body(error.status, error.reason), status_code=error.status)
        generate = GenerateRequest(prompt=parsed.prompt, max_new_tokens=parsed.max_tokens,
                                   temperature=parsed.temperature, seed=parsed.seed)
        output, _ = await self._generate_one(generate)
        text, stopped = apply_stop(output.text, parsed.stop)
        self._account(started)
        return JSONResponse(completion_response(
            request_id=f"cmpl-{uuid.uuid4().hex}", model_name=self._model_name, created=int(time.time()), text=text,
            finish_reason="stop" if stopped else output.finish_reason, prompt_tokens=output.prompt_tokens,
            completion_tokens=output.completion_tokens,
        ))

    async def _generate_one(self, request: GenerateRequest) -> tuple[TextOutput, int]:
        self._ongoing += 1
        try:
            return await self._generate_batch(request)
        finally:
            self._ongoing -= 1

    def _account(self, started: float) -> float:
        latency = time.perf_counter() - started
        self._pending_latencies.append(latency)
        self._metrics.request(latency_s=latency, replica=self._replica, node=self._node)
        return latency

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.01)
    async def _generate_batch(self, requests: list[GenerateRequest]) -> list[tuple[TextOutput, int]]:
        generator, step = self._generator, self._step
        started = time.perf_counter()
        outputs = await asyncio.to_thread(generator.generate, requests)
        self._pending_busy_s += time.perf_counter() - started
        return [(output, step) for output in outputs]

    def _ensure_reporter(self) -> None:
        if self._reporter is None or self._reporter.done():
            self._reporter = asyncio.get_running_loop().create_task(self._report_forever())

    async def _report_forever(self) -> None:
        while True:
            latencies, self._pending_latencies = self._pending_latencies, []
            busy_s, self._pending_busy_s = self._pending_busy_s, 0.0
            newest = await self._registry.report.remote(
                self._replica, latencies, busy_s, self._ongoing, self._version,
                device=(self._node, self._devices[0]) if self._devices else None,
            )
            self._metrics.queue_depth(self._ongoing, replica=self._replica)
            if newest != self._version:
                await self._load_newest_weights()
            await asyncio.sleep(REPORT_INTERVAL_S)
