"""Rollouts on the serving replicas of the pool: every completion of an iteration requested at once
through the application's deployment handle, so Serve spreads them over its replicas and each replica
batches what it holds.

A request whose replica dies mid-answer (the handle raises ActorDiedError) is issued again, from the
start, to whichever replica Serve picks; its seed makes the answer the same (`GRPOConfig.sample_seed`),
so a run with a replica killed matches the run without. Sampling draws from the whole distribution
(no top-k): the policy gradient is taken for the policy as it is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Sequence

import ray

from baige_ray.serving.causal_lm_generation import SamplingParams

FIRST_RETRY_PAUSE_S = 0.25  # doubled after each failure: Serve needs a moment to stop routing to a dead replica
MAX_RETRY_PAUSE_S = 4.0


@dataclasses.dataclass(frozen=True)
class RolloutRequest:
    prompt: tuple[int, ...]
    params: SamplingParams


@dataclasses.dataclass
class RolloutStats:
    reissued: int = 0  # requests issued again after their replica failed
    failures: list[str] = dataclasses.field(default_factory=list)


class RolloutClient:
    """Completions of token prompts from a `serve()` application's replicas (the built-in engine or vLLM)."""

    def __init__(self, app_name: str, deployment_name: str, *, eos_token_id: int | None, retry_s: float):
        from ray import serve

        self._handle = serve.get_deployment_handle(deployment_name, app_name=app_name)
        self.eos_token_id, self.retry_s = eos_token_id, retry_s

    def generate(self, requests: Sequence[RolloutRequest],
                 generating: threading.Event | None = None) -> tuple[list[list[int]], RolloutStats]:
        """Each request's completion: its sampled tokens, ending with the end-of-text token when the
        model chose to stop (it is trained to stop, so the token is part of what it did).
        `generating` is set once the first token arrived (replicas are busy with the batch)."""
        stats = RolloutStats()
        return asyncio.run(self._all(requests, stats, generating or threading.Event())), stats

    async def _all(self, requests: Sequence[RolloutRequest], stats: RolloutStats,
                   generating: threading.Event) -> list[list[int]]:
        return list(await asyncio.gather(*(self._one(request, stats, generating) for request in requests)))

    async def _one(self, request: RolloutRequest, stats: RolloutStats, generating: threading.Event) -> list[int]:
        deadline, pause = time.monotonic() + self.retry_s, FIRST_RETRY_PAUSE_S
        while True:
            try:
                tokens = []
                async for token in self._handle.options(stream=True).token_stream.remote(list(request.prompt),
                                                                                         request.params):
                    tokens.append(token)
                    generating.set()
                break
            except ray.exceptions.RayActorError as error:  # its replica died: the answer is made again from the start
                stats.failures.append(f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}")
                if time.monotonic() + pause > deadline:
                    raise RuntimeError(f"a rollout request kept failing for {self.retry_s:g}s; last: "
                                       f"{stats.failures[-1]}") from error
                stats.reissued += 1
                await asyncio.sleep(pause)
                pause = min(2 * pause, MAX_RETRY_PAUSE_S)
        if len(tokens) < request.params.max_new_tokens and self.eos_token_id is not None:
            tokens.append(self.eos_token_id)  # it stopped before its budget: it sampled end-of-text
        return tokens
