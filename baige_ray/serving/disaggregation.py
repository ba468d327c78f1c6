"""Prefill/decode disaggregation on Ray Serve: prefill replicas and decode replicas, the KV cache
handed from one to the other.

`serve(..., disaggregation=DisaggregationOptions(...))` deploys two deployments instead of one:

- `DecodeServer` replicas take the HTTP routes, with the same answers as `ModelServer` (streaming
  included). For each request a decode replica asks a prefill replica, through a deployment handle
  (Serve picks the one with fewer requests in hand), to run the prompt. The answer, a
  `PrefilledRequest` (first token, the prompt's KV cache, the sampling generator's state), comes back
  through Ray's object store; the decode replica streams the first token and adds the request to its
  running batch, which decodes the rest. A long prompt thus never runs inside the decode batch's
  steps, where it would delay every running row's next token.
- `PrefillServer` replicas run a `PrefillEngine` (serving/prefill.py): batched prefills, no decoding.

Both load weights from the application's registry and report to it, each with its role and its
engine's queue; those reports size each side (policies/disaggregation.py, applied by
serving/disaggregation_scaling.py and the pool arbiter). A hand-off made on weights other than the
decode replica's (a weight swap reaches the two sides a moment apart) is not continued: the decode
replica prefills that request itself. The built-in engine only: vLLM's replicas are colocated.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from baige_ray.api.validation import require_int
from baige_ray.models.plugin import plugin_for
from baige_ray.policies.disaggregation import SplitPolicy
from baige_ray.serving.causal_lm_generation import SamplingParams
from baige_ray.serving.deployment import WARMUP_TOKENS, ModelServer
from baige_ray.serving.engine import EngineFull, PrefilledRequest, TokenEvent
from baige_ray.serving.engine_runner import EngineRunner
from baige_ray.serving.generators import text_generator
from baige_ray.serving.prefill import PrefillEngine

PREFILL_DEPLOYMENT = "PrefillServer"
DECODE_DEPLOYMENT = "DecodeServer"


@dataclass(kw_only=True, frozen=True)
class DisaggregationOptions:
    prefill_replicas: int = 1
    decode_replicas: int = 1
    max_prefill_batch_size: int = 8  # prompts one prefill step takes (one forward per distinct length)
    split: SplitPolicy = field(default_factory=SplitPolicy)  # how load moves replicas between the sides

    def __post_init__(self) -> None:
        for name in ("prefill_replicas", "decode_replicas", "max_prefill_batch_size"):
            require_int("DisaggregationOptions", name, getattr(self, name), minimum=1)
        if not isinstance(self.split, SplitPolicy):
            raise ValueError(f"DisaggregationOptions.split={self.split!r} is invalid: expected a SplitPolicy")
        for side in ("prefill", "decode"):
            wanted, minimum = getattr(self, f"{side}_replicas"), getattr(self.split, f"min_{side}_replicas")
            if wanted < minimum:
                raise ValueError(f"DisaggregationOptions.{side}_replicas={wanted} is invalid: expected at least "
                                 f"split.min_{side}_replicas={minimum}")


class PrefillServer(ModelServer):
    """Runs prompts for the decode replicas. It is not the application's ingress, so no HTTP reaches
    it; from `ModelServer` it keeps the weight loading and the reports to the registry."""

    ROLE = "prefill"

    def _build_runner(self, model_config, state: dict, *, first: bool, version: int) -> EngineRunner:
        plugin = plugin_for(model_config)
        generator = text_generator(plugin, state)
        engine = PrefillEngine(generator.decoder, eos_token_id=generator.codec.eos_token_id, limits=self._engine_limits,
                               prefixes=self._prefix_store(plugin, version))
        if first:  # a fresh process's first forwards are slow (see ModelServer); not on a request's time
            warmup = SamplingParams(max_new_tokens=WARMUP_TOKENS, temperature=1.0, seed=0)
            for _ in range(self._engine_limits.max_batch_size):
                engine.submit(generator.encode("warm up"), warmup, lambda prefilled: None)
            engine.step()
        return EngineRunner(engine, generator.codec)

    def _events(self, runner: EngineRunner, prompt: list[int], params: SamplingParams) -> AsyncIterator[TokenEvent]:
        raise RuntimeError("a prefill replica does not decode: send requests to the application's decode replicas")

    async def prefill(self, prompt: list[int], params: SamplingParams, known_tokens: int = 0) -> PrefilledRequest:
        """The request's hand-off, stamped with the weights version that ran it; without the keys and values
        of the first `known_tokens` tokens (the decode replica's prefix cache holds them)."""
        self._ensure_reporter()
        runner, version = self._require_runner(), self._version
        prefilled = await runner.prefill(prompt, params, known_tokens)
        return dataclasses.replace(prefilled, weights_version=version)


class DecodeServer(ModelServer):
    """The HTTP routes of `ModelServer`, its requests prefilled by `PrefillServer` replicas."""

    ROLE = "decode"

    async def __init__(self, *, prefill: DeploymentHandle, **options):
        self._prefill = prefill
        await super().__init__(**options)

    def _events(self, runner: EngineRunner, prompt: list[int], params: SamplingParams) -> AsyncIterator[TokenEvent]:
        return self._handed_off(runner, self._version, prompt, params)

    async def _handed_off(self, runner: EngineRunner, version: int, prompt: list[int],
                          params: SamplingParams) -> AsyncIterator[TokenEvent]:
        try:
            prefilled = await self._prefill.prefill.remote(prompt, params, runner.engine.known_prefix_tokens(prompt))
        except BackPressureError as error:
            raise EngineFull(f"the prefill replicas' queues are full: {error}") from error
        if prefilled.weights_version == version:
            events = runner.continued(prefilled)
        else:  # its cache came from other weights than this runner's
            events = runner.tokens(prompt, params)
        async with contextlib.aclosing(events):  # closing cancels the request
            async for event in events:
                yield event


def bind_disaggregated(options: DisaggregationOptions, *, deployment_options: dict, server_options: dict,
                       max_queued_requests: int):
    """The application: decode replicas (the ingress, with `max_queued_requests` at the proxy) holding a
    handle to the prefill replicas. The prefill side queues without bound: only the decode replicas'
    requests reach it, and those are bounded already."""
    from ray import serve as ray_serve

    prefill_limits = {"max_batch_size": options.max_prefill_batch_size,
                      "max_waiting": deployment_options["max_ongoing_requests"]}
    prefill = ray_serve.deployment(PrefillServer).options(
        name=PREFILL_DEPLOYMENT, num_replicas=options.prefill_replicas, max_queued_requests=-1, **deployment_options,
    ).bind(**{**server_options, "engine_limits": prefill_limits})
    return ray_serve.deployment(DecodeServer).options(
        name=DECODE_DEPLOYMENT, num_replicas=options.decode_replicas, max_queued_requests=max_queued_requests,
        **deployment_options,
    ).bind(prefill=prefill, **server_options)
