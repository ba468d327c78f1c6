"""Cache-aware routing: requests go to the replica that holds their prompt's longest prefix.

`serve(..., routing="prefix")` puts a thin ingress (`PrefixRoutingIngress`) in front of the model's
replicas. Serve's HTTP proxy hands the ingress an ASGI request, whose body a request router cannot
read; the ingress reads it, takes the text the prompt starts with (the completion's prompt, the
chat's messages) and forwards the request whole (`RoutedRequest`) through a deployment handle. That
handle routes with `PrefixAffinityRouter`, a Ray Serve `RequestRouter` configured on the replicas'
deployment: it looks the text's blocks up in its index (serving/prefix_index.py), asks the policy
(policies/prefix_routing.py) which replicas to try, and records where the request went. The replica
answers as it answers HTTP (`ModelServer.routed`), streamed back through the handle, so responses,
streaming, errors and status codes are the same as without the ingress.

Why not Serve's `PrefixCacheAffinityRouter` (ray.serve.llm): it reads the same kind of prompt
attribute, but importing it loads Ray's LLM stack (8.5 s here), its prefix tree is a detached actor
that asks for a CPU to schedule on (a pool whose CPUs training holds never places it), and each
decision waits on that actor with a blocking `ray.get` in the router's event loop.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from baige_ray.api.validation import require_int
from baige_ray.policies.prefix_routing import RoutingObservation, choose_heir, choose_replicas
from baige_ray.serving.kv_blocks import BlockHandover
from baige_ray.serving.openai_responses import error_body
from baige_ray.serving.prefix_index import DEFAULT_BLOCK_CHARS, DEFAULT_BLOCKS_PER_REPLICA, PrefixIndex, text_block_ids
from baige_ray.serving.requests import RequestError, decode_json_object, read_body

INGRESS_DEPLOYMENT = "PrefixRoutingIngress"
DEFAULT_OVERLOAD_MARGIN = 4
RETRY_AFTER_S = 1
# The parts of the ASGI scope the replica needs to answer as if the request had come to it.
_SCOPE_KEYS = ("type", "http_version", "method", "scheme", "path", "raw_path", "root_path", "query_string",
               "headers", "server", "client")


@dataclass(frozen=True)
class RoutedRequest:
    """An HTTP request as the ingress forwards it: `prompt` is what the router matches on ("" for none)."""

    scope: dict
    body: bytes
    prompt: str


@dataclass(frozen=True)
class ResponseHead:
    """What a replica's answer starts with; body chunks follow."""

    status: int
    headers: list[tuple[bytes, bytes]]
    streamed: bool  # server-sent events: relay each chunk as it comes


def routing_text(body: bytes) -> str:
    """The text a request's prompt starts with: a completion's prompt (or its first, for a list), a
    chat's messages in order; "" when the body has neither (the replica then says what is wrong)."""
    try:
        payload = decode_json_object(body, max(len(body), 1))
    except RequestError:
        return ""
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    messages = payload.get("messages")
    if isinstance(messages, list):
        return "".join(f"<{m.get('role')}>{m.get('content')}" for m in messages if isinstance(m, dict))
    return ""


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """Routes a `RoutedRequest` to the replica holding its prompt's longest prefix, unless that replica is
    overloaded; anything else (no prompt) to the less loaded of two replicas, as Serve's default does."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._block_chars, self._overload_margin = DEFAULT_BLOCK_CHARS, DEFAULT_OVERLOAD_MARGIN
        self._index = PrefixIndex(DEFAULT_BLOCKS_PER_REPLICA)

    def initialize_state(self, block_chars: int = DEFAULT_BLOCK_CHARS,
                         blocks_per_replica: int = DEFAULT_BLOCKS_PER_REPLICA,
                         overload_margin: int = DEFAULT_OVERLOAD_MARGIN) -> None:
        require_int("PrefixAffinityRouter", "block_chars", block_chars, minimum=1)
        require_int("PrefixAffinityRouter", "overload_margin", overload_margin, minimum=1)
        self._block_chars, self._overload_margin = block_chars, overload_margin
        self._index = PrefixIndex(blocks_per_replica)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        if _arg(pending_request, "departed") and by_id:  # a stopping replica's blocks
            ranks = choose_heir({unique: self._index.num_blocks(unique) for unique in by_id})
            return [[by_id[unique] for unique in rank] for rank in ranks]
        text = _prompt_of(pending_request)
        if not text or not by_id:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        observation = RoutingObservation(
            matched_blocks=self._index.matched_blocks(text_block_ids(text, self._block_chars), by_id),
            queue_lengths={unique: self.replica_queue_len_cache.get(replica.replica_id)
                           for unique, replica in by_id.items()},
            overload_margin=self._overload_margin,
        )
        decision = choose_replicas(observation)
        return [[by_id[unique] for unique in rank] for rank in decision.ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        if departed := _arg(pending_request, "departed"):
            self._index.transfer(departed, replica_id.unique_id)
            return
        text = _prompt_of(pending_request)
        if text:
            self._index.record(text_block_ids(text, self._block_chars), replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._index.keep_only(replica.replica_id.unique_id for replica in replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._index.keep_only(unique.unique_id for unique in self.curr_replicas)


def _prompt_of(pending_request: PendingRequest | None) -> str:
    return _arg(pending_request, "prompt")


def _arg(pending_request: PendingRequest | None, name: str) -> str:
    """The string attribute `name` of the request's first argument ("" if none): a RoutedRequest's
    `prompt`, a BlockHandover's `departed`."""
    if pending_request is None or not pending_request.args:
        return ""
    # By attribute, as Serve's own routers read prompts: the ingress's class reaches its replica pickled by
    # value, so the requests it sends are instances of a copy of RoutedRequest, not of this module's.
    value = getattr(pending_request.args[0], name, None)
    return value if isinstance(value, str) else ""


def router_config(overload_margin: int = DEFAULT_OVERLOAD_MARGIN) -> dict:
    """The replicas' deployment option that makes handles route with PrefixAffinityRouter."""
    from baige_ray.serving.request_routing import request_router_config

    # By its import path: every handle imports the router instead of unpickling a copy of it.
    return request_router_config(request_router_class=f"{__name__}.{PrefixAffinityRouter.__name__}",
                                 request_router_kwargs={"overload_margin": overload_margin})


class PrefixRoutingIngress:
    """Takes the application's HTTP requests and forwards each to a replica through a handle that routes by
    prefix; relays the replica's answer (status, headers, body; server-sent events as they come)."""

    def __init__(self, servers: DeploymentHandle, max_body_bytes: int):
        self._servers = servers.options(method_name="routed", stream=True)
        self._adopters = servers.options(method_name="adopt_blocks")
        self._max_body_bytes = max_body_bytes

    async def hand_over(self, handover: BlockHandover) -> int:
        """A stopping replica's hottest blocks, to the peer this ingress's router picks (it credits the
        departed replica's prefixes to that peer); how many the peer kept."""
        return await self._adopters.remote(handover)

    async def __call__(self, request: Request) -> Response:
        try:
            body = await read_body(request, self._max_body_bytes)
        except RequestError as error:  # in the shape the replica would answer in on that route
            openai = "/v1/" in request.url.path
            shaped = error_body(error.status, error.reason, error.param) if openai else {"error": error.reason}
            return JSONResponse(shaped, status_code=error.status)
        scope = {key: request.scope[key] for key in _SCOPE_KEYS if key in request.scope}
        answer = self._servers.remote(RoutedRequest(scope=scope, body=body, prompt=routing_text(body)))
        try:
            head: ResponseHead = await answer.__anext__()
        except BackPressureError as error:  # every replica's queue is full: as the proxy answers then
            return JSONResponse({"error": f"the replicas are overloaded ({error}); retry after {RETRY_AFTER_S} s"},
                                status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        headers = {key.decode("latin-1"): value.decode("latin-1") for key, value in head.headers
                   if key.lower() != b"content-length"}
        if head.streamed:
            return StreamingResponse(_relay(answer), status_code=head.status, headers=headers)
        return Response(b"".join([chunk async for chunk in answer]), status_code=head.status, headers=headers)


async def _relay(answer) -> AsyncIterator[bytes]:
    try:
        async for chunk in answer:
            yield chunk
    finally:
        answer.cancel()  # the client left: the replica's request leaves its batch
