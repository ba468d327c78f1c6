"""Rollouts on the serving replicas of the pool: the groups of an iteration (a prompt and one sampling of
it per completion) are dealt into one share per replica, and every share is requested at once through the
application's deployment handle. The application takes one call at a time per replica
(`max_ongoing_requests=1`), so Serve puts each share on a replica of its own, and each replica decodes
its share in one batch. Left to Serve's power-of-two choices, four groups landed 1 + 3 or 4 + 0 on two
replicas in 15 of 20 rollouts, and the rollout took as long as the busiest replica. A share travels as
one call and comes back as one answer (`ModelServer.token_completions`), not a message per token.

A share whose replica dies mid-answer (the handle raises ActorDiedError) is issued again, from the
start, to whichever replica Serve picks once one is free; its seeds make the answers the same
(`GRPOConfig.sample_seed`), so a run with a replica killed matches the run without. Sampling draws from
the whole distribution (no top-k): the policy gradient is taken for the policy as it is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Sequence

import ray

from baige_ray.serving.causal_lm_generation import Generation, SamplingParams

FIRST_RETRY_PAUSE_S = 0.25  # doubled after each failure: Serve needs a moment to stop routing to a dead replica
MAX_RETRY_PAUSE_S = 4.0


@dataclasses.dataclass(frozen=True)
class RolloutGroup:
    """Completions of one prompt: one per sampling (each with its own seed)."""

    prompt: tuple[int, ...]
    params: tuple[SamplingParams, ...]


class BusyReplicas:
    """The replicas that began sampling, by process id, in the order their first token came: what a fault
    injector waits on to kill a replica that holds requests (not one Serve left idle)."""

    def __init__(self):
        self._pids: list[int] = []
        self._changed = threading.Condition()

    def started(self, pid: int) -> None:
        with self._changed:
            self._pids.append(pid)
            self._changed.notify_all()

    def wait_for_one(self, timeout_s: float, *, besides: Sequence[int] = ()) -> int | None:
        """The first busy replica not in `besides`, once there is one; None after `timeout_s`."""
        with self._changed:
            self._changed.wait_for(lambda: self._first_besides(besides) is not None, timeout_s)
            return self._first_besides(besides)

    def _first_besides(self, besides: Sequence[int]) -> int | None:
        return next((pid for pid in self._pids if pid not in besides), None)


def deal_shares(group_sizes: Sequence[int], num_replicas: int, max_share: int | None = None) -> list[list[int]]:
    """The groups' indices dealt round-robin into one share per replica (fewer where there are fewer
    groups), or more shares where one would hold more than `max_share` sequences."""
    per_share = len(group_sizes) if max_share is None else max(1, max_share // max(group_sizes))
    count = max(min(num_replicas, len(group_sizes)), -(-len(group_sizes) // per_share))
    return [list(range(first, len(group_sizes), count)) for first in range(count)]


@dataclasses.dataclass(frozen=True)
class Completion:
    """One sampled completion: its tokens, ending with the end-of-text token when the model chose to stop
    (it is trained to stop, so the token is part of what it did), and the log-probability the sampling
    engine gave each of them (None when it was not asked for them)."""

    tokens: list[int]
    log_probs: list[float] | None = None


@dataclasses.dataclass
class RolloutStats:
    reissued: int = 0  # completions requested again after their replica failed
    failures: list[str] = dataclasses.field(default_factory=list)


class RolloutClient:
    """Completions of token prompts from a `serve()` application's replicas (the built-in engine or vLLM)."""

    def __init__(self, app_name: str, deployment_name: str, *, eos_token_id: int | None, retry_s: float):
        from ray import serve

        self._handle = serve.get_deployment_handle(deployment_name, app_name=app_name)
        self.eos_token_id, self.retry_s = eos_token_id, retry_s

    def generate(self, groups: Sequence[RolloutGroup], busy: BusyReplicas | None = None, num_replicas: int = 1,
                 max_share: int | None = None) -> tuple[list[Completion], RolloutStats]:
        """Every group's completions, group after group, the groups dealt into one share per replica
        (`num_replicas`), or more where a share would hold more than `max_share` sequences (a replica's
        batch: the shares beyond one per replica wait for a free one). `busy` learns each replica that
        sampled a first token for a share."""
        stats = RolloutStats()
        shares = deal_shares([len(group.params) for group in groups], num_replicas, max_share)
        answers = asyncio.run(self._all([[groups[i] for i in share] for share in shares], stats,
                                        busy or BusyReplicas()))
        by_group = {index: answer for share, share_answers in zip(shares, answers)
                    for index, answer in zip(share, share_answers)}
        return [completion for index in range(len(groups)) for completion in by_group[index]], stats

    async def _all(self, shares: list[list[RolloutGroup]], stats: RolloutStats,
                   busy: BusyReplicas) -> list[list[list[Completion]]]:
        return list(await asyncio.gather(*(self._share(share, stats, busy) for share in shares)))

    async def _share(self, groups: list[RolloutGroup], stats: RolloutStats,
                     busy: BusyReplicas) -> list[list[Completion]]:
        deadline, pause = time.monotonic() + self.retry_s, FIRST_RETRY_PAUSE_S
        request = [(list(group.prompt), list(group.params)) for group in groups]
        while True:
            try:
                async for answer in self._handle.options(stream=True).token_completions.remote(request):
                    if isinstance(answer, int):  # the replica's process id: it began sampling the share
                        busy.started(answer)
                    else:
                        completions = answer
                break
            except ray.exceptions.RayActorError as error:  # its replica died: the answers are made again from the start
                stats.failures.append(f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}")
                if time.monotonic() + pause > deadline:
                    raise RuntimeError(f"a rollout share kept failing for {self.retry_s:g}s; last: "
                                       f"{stats.failures[-1]}") from error
                stats.reissued += sum(len(group.params) for group in groups)
                await asyncio.sleep(pause)
                pause = min(2 * pause, MAX_RETRY_PAUSE_S)
        return [[self._completion(generation) for generation in group] for group in completions]

    def _completion(self, generation: Generation) -> Completion:
        return completion_of(generation, self.eos_token_id, source="a rollout replica")


def completion_of(generation: Generation, eos_token_id: int | None, source: str = "the engine") -> Completion:
    """A generation as the loss takes it: the end-of-text token it stopped at appended to its tokens."""
    tokens = list(generation.tokens)
    if generation.finish_reason == "stop" and eos_token_id is not None:
        tokens.append(eos_token_id)  # it stopped before its budget: it sampled end-of-text
    log_probs = generation.log_probs
    if log_probs is not None and len(log_probs) != len(tokens):
        raise RuntimeError(f"{source} answered {len(tokens)} tokens with {len(log_probs)} "
                           "log-probabilities: expected one each")
    return Completion(tokens, None if log_probs is None else list(log_probs))
