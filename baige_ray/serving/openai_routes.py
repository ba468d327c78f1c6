"""The OpenAI routes of a serving replica (`ModelServer` holds one): completions, chat, vLLM's
tokenize and detokenize, and the model list.

A completions request with several prompts runs them as separate requests of the engine, together,
and answers one choice per prompt (OpenAI's `index`); streamed, their chunks interleave as they come.
Everything a request asks for is checked before anything is submitted or streamed: a prompt that does
not fit the context, or a sampling field the replica's engine does not implement at the value asked
(sampling_params.py), is a 400, never a 500 or a half-sent stream.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from baige_ray.models.plugin import plugin_for
from baige_ray.serving.async_streams import first_items, gather_cancelling, merged
from baige_ray.serving.context_length import openai_budget
from baige_ray.serving.engine_runner import EngineFailed, EngineRunner
from baige_ray.serving.generators import TextOutput
from baige_ray.serving.openai_api import CompletionLimits, parse_completion_request
from baige_ray.serving.openai_chat import parse_chat_request
from baige_ray.serving.openai_prompts import prompt_tokens
from baige_ray.serving.openai_responses import (
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    error_body,
    model_card,
    models_response,
    server_sent_event,
    usage_chunk,
)
from baige_ray.serving.openai_sampling import with_budget
from baige_ray.serving.openai_tokenize import chat_prompt_tokens, detokenize_response, tokenize_response
from baige_ray.serving.requests import RequestError, bad_request, read_body
from baige_ray.serving.sampling_params import SamplingParams, unsupported_field

MODEL_ROUTE = "v1/models/{id}"


def served_root(model_config: Any, app_name: str) -> str:
    """Where the served model was loaded from (vLLM's `root`): its directory, else the application's name."""
    path = getattr(model_config, "path", None)
    return str(path) if path is not None else app_name


def require_supported(sampling: SamplingParams, engine: str) -> None:
    refused = unsupported_field(sampling, engine)
    if refused is not None:
        raise bad_request(*refused)


def fitted_requests(prompts: Sequence[list[int]], parsed: Any,
                    max_context: int) -> list[tuple[list[int], SamplingParams]]:
    """(prompt, sampling) to submit for each prompt: cut to `truncate_prompt_tokens` where asked, with the
    budget asked for, cut to the rest of the context as vLLM cuts it; a 400 when a prompt leaves no room."""
    field = getattr(parsed, "max_tokens_field", "max_tokens")
    requests = []
    for prompt in prompts:
        fitted, budget = openai_budget(prompt, max_tokens=parsed.max_tokens, max_context=max_context,
                                       truncate_prompt_tokens=parsed.truncate_prompt_tokens)
        requests.append((fitted, with_budget(parsed.sampling, budget, field)))
    return requests


@dataclass(frozen=True)
class ReplicaCalls:
    """What the OpenAI routes ask of the replica that holds them: its engine runner (or EngineFull while it
    loads), a request run to its end or as text deltas, the latency accounts, and its count of ongoing
    requests (the load it reports)."""

    require_runner: Callable[[], EngineRunner]
    complete: Callable[[EngineRunner, list[int], SamplingParams], Awaitable[TextOutput]]
    text: Callable[[EngineRunner, list[int], SamplingParams], AsyncIterator[str | TextOutput]]
    account: Callable[[float], float]
    account_failure: Callable[[float], None]
    count_ongoing: Callable[[int], None]


class OpenAIRoutes:
    """The OpenAI-shaped handlers of one replica; `learn_model` tells it the context and vocabulary that later
    requests are checked against."""

    def __init__(self, calls: ReplicaCalls, *, app_name: str, engine_name: str, limits: CompletionLimits):
        self.calls, self.app_name, self.engine_name, self.limits = calls, app_name, engine_name, limits
        self.created = int(time.time())
        self.root = app_name

    def learn_model(self, model_config: Any, max_context: int) -> None:
        vocab_size = plugin_for(model_config).model_spec(global_batch=1).vocab_size
        self.limits = dataclasses.replace(self.limits, max_context=max_context, vocab_size=vocab_size)
        self.root = served_root(model_config, self.app_name)

    def models(self, route: str) -> JSONResponse:
        card = dict(root=self.root, max_model_len=self.limits.max_context)
        if route == "v1/models":
            return JSONResponse(models_response(self.app_name, self.created, **card))
        wanted = route.removeprefix("v1/models/")
        if wanted != self.app_name:
            raise RequestError(404, f"The model `{wanted}` does not exist.", param="model")
        return JSONResponse(model_card(self.app_name, self.created, **card))

    async def tokenize(self, request: Request, started: float) -> Response:
        body = await read_body(request, self.limits.max_body_bytes)
        runner = self.calls.require_runner()
        return JSONResponse(tokenize_response(body, self.limits, runner.codec, model_name=self.app_name))

    async def detokenize(self, request: Request, started: float) -> Response:
        body = await read_body(request, self.limits.max_body_bytes)
        runner = self.calls.require_runner()
        return JSONResponse(detokenize_response(body, self.limits, runner.codec, model_name=self.app_name))

    async def completion(self, request: Request, started: float) -> Response:
        body = await read_body(request, self.limits.max_body_bytes)
        parsed = parse_completion_request(body, self.limits, model_name=self.app_name)
        require_supported(parsed.sampling, self.engine_name)
        runner = self.calls.require_runner()
        prompts = [prompt_tokens(prompt, runner.codec.encode) for prompt in parsed.prompts]
        return await self._respond(runner, prompts, parsed, started, chat=False)

    async def chat(self, request: Request, started: float) -> Response:
        body = await read_body(request, self.limits.max_body_bytes)
        parsed = parse_chat_request(body, self.limits, model_name=self.app_name)
        require_supported(parsed.sampling, self.engine_name)
        runner = self.calls.require_runner()
        return await self._respond(runner, [chat_prompt_tokens(runner.codec, parsed.messages)], parsed, started,
                                   chat=True)

    async def _respond(self, runner: EngineRunner, prompts: list[list[int]], parsed: Any, started: float, *,
                       chat: bool) -> Response:
        requests = fitted_requests(prompts, parsed, runner.engine.max_context)  # before anything is submitted
        shape = dict(request_id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", model_name=self.app_name,
                     created=int(time.time()))
        if not parsed.stream:
            outputs = await gather_cancelling([self.calls.complete(runner, prompt, params)
                                               for prompt, params in requests])
            self.calls.account(started)
            return JSONResponse(_whole(shape, outputs, chat))
        streams = [self.calls.text(runner, prompt, params) for prompt, params in requests]
        firsts = await first_items(streams)  # submits the requests: a full engine raises EngineFull before any byte
        events = self._stream_events(firsts, streams, shape, chat, parsed.include_usage, started)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def _stream_events(self, firsts: list, streams: list[AsyncIterator[str | TextOutput]], shape: dict,
                             chat: bool, include_usage: bool, started: float) -> AsyncIterator[bytes]:
        self.calls.count_ongoing(+1)
        pieces = merged(firsts, streams)
        chunks = _stream_chunks(pieces, shape, chat, include_usage)
        try:
            async for event in chunks:
                yield event
            self.calls.account(started)
        except EngineFailed as error:  # the status line went out with the first chunk: the stream ends with an error
            self.calls.account_failure(started)
            yield server_sent_event(error_body(500, str(error)))
            yield server_sent_event("[DONE]")
        finally:
            self.calls.count_ongoing(-1)
            # A client gone mid-stream: its requests leave the batch. The merge first, whose readers hold the
            # streams; then the streams, in case the merge never started.
            await chunks.aclose()
            await pieces.aclose()
            for stream in streams:
                await stream.aclose()


def _whole(shape: dict, outputs: list[TextOutput], chat: bool) -> dict:
    counts = dict(prompt_tokens=sum(o.prompt_tokens for o in outputs),
                  completion_tokens=sum(o.completion_tokens for o in outputs))
    if chat:
        (output,) = outputs
        return chat_response(**shape, text=output.text, finish_reason=output.finish_reason, **counts)
    return completion_response(**shape, choices=[(o.text, o.finish_reason) for o in outputs], **counts)


async def _stream_chunks(pieces: AsyncIterator[tuple[int, str | TextOutput]], shape: dict, chat: bool,
                         include_usage: bool) -> AsyncIterator[bytes]:
    if chat:
        yield server_sent_event(chat_chunk(**shape, delta={"role": "assistant", "content": ""}, finish_reason=None))
    prompt_tokens_total = completion_tokens_total = 0
    async for index, piece in pieces:
        if isinstance(piece, TextOutput):
            prompt_tokens_total += piece.prompt_tokens
            completion_tokens_total += piece.completion_tokens
            text, delta, finish_reason = "", {}, piece.finish_reason
        else:
            text, delta, finish_reason = piece, {"content": piece}, None
        yield server_sent_event(chat_chunk(**shape, delta=delta, finish_reason=finish_reason, index=index) if chat
                                else completion_chunk(**shape, text=text, finish_reason=finish_reason, index=index))
    if include_usage:
        yield server_sent_event(usage_chunk(**shape, object_name="chat.completion.chunk" if chat else "text_completion",
                                            prompt_tokens=prompt_tokens_total,
                                            completion_tokens=completion_tokens_total))
    yield server_sent_event("[DONE]")
