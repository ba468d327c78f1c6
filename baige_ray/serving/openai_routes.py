"""The OpenAI routes of a serving replica (`ModelServer` holds one): completions, chat, vLLM's
tokenize and detokenize, and the model list.

A completions request with several prompts, or any request with `n` > 1, runs each choice as a separate
request of the engine, together, and answers every choice (OpenAI's `index`; openai_choices.py: echo,
log-probabilities, usage); streamed, their chunks interleave as they come. Everything a request asks
for is checked before anything is submitted or streamed: a prompt that does not fit the context, or a
sampling field the replica's engine does not take at the value asked (sampling_params.py), is a 400,
never a 500 or a half-sent stream.
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
from baige_ray.serving.generators import TextDelta, TextOutput
from baige_ray.serving.openai_api import CompletionLimits, UsageOptions, check_model, parse_completion_request
from baige_ray.serving.openai_chat import parse_chat_request
from baige_ray.serving.openai_choices import AnswerShaper, fan_out, usage_counts
from baige_ray.serving.openai_prompts import Prompt, prompt_tokens
from baige_ray.serving.openai_responses import (
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    error_body,
    model_card,
    models_response,
    server_sent_event,
    usage,
    usage_chunk,
)
from baige_ray.serving.openai_sampling import with_budget
from baige_ray.serving.openai_tokenize import chat_prompt_tokens, detokenize_response, tokenize_response
from baige_ray.serving.requests import bad_request, read_body
from baige_ray.serving.sampling_params import SamplingParams, unsupported_field
from baige_ray.serving.tool_calls import ToolCallParsing

MODEL_ROUTE = "v1/models/{id}"


def served_root(model_config: Any, app_name: str) -> str:
    """Where the served model was loaded from (vLLM's `root`): its directory, else the application's name."""
    path = getattr(model_config, "path", None)
    return str(path) if path is not None else app_name


def require_supported(sampling: SamplingParams, engine: str) -> None:
    refused = unsupported_field(sampling, engine)
    if refused is not None:
        raise bad_request(*refused)


def fitted_requests(prompts: Sequence[list[int]], parsed: Any, max_context: int,
                    limit: str | None = None) -> list[tuple[list[int], SamplingParams]]:
    """(prompt, sampling) to submit for each prompt: cut to `truncate_prompt_tokens` where asked, with the
    budget asked for, cut to the rest of the context as vLLM cuts it; a 400 when a prompt leaves no room
    (`limit`: why the engine's context is below the model's, said in that 400)."""
    field = getattr(parsed, "max_tokens_field", "max_tokens")
    max_tokens = 1 if parsed.max_tokens == 0 else parsed.max_tokens  # echo's max_tokens=0 generates one, unshown
    requests = []
    for prompt in prompts:
        fitted, budget = openai_budget(prompt, max_tokens=max_tokens, max_context=max_context,
                                       truncate_prompt_tokens=parsed.truncate_prompt_tokens, limit=limit)
        requests.append((fitted, with_budget(parsed.sampling, budget, field)))
    return requests


@dataclass(frozen=True)
class ReplicaCalls:
    """What the OpenAI routes ask of the replica that holds them: its engine runner (or EngineFull while it
    loads), a request run to its end or as text deltas, the latency accounts, and its count of ongoing
    requests (the load it reports)."""

    require_runner: Callable[[], EngineRunner]
    complete: Callable[[EngineRunner, list[int], SamplingParams], Awaitable[TextOutput]]
    text: Callable[[EngineRunner, list[int], SamplingParams], AsyncIterator[TextDelta | TextOutput]]
    account: Callable[[float], float]
    account_failure: Callable[[float], None]
    count_ongoing: Callable[[int], None]


class OpenAIRoutes:
    """The OpenAI-shaped handlers of one replica; `learn_model` tells it the context and vocabulary that later
    requests are checked against."""

    def __init__(self, calls: ReplicaCalls, *, app_name: str, engine_name: str, limits: CompletionLimits,
                 adapters: dict[str, str] | None = None, tool_call_parser: str | None = None):
        """`adapters`: the LoRA adapters served beside the model, name -> where each came from.
        `tool_call_parser`: the vLLM tool-call parser chat answers go through (serving/tool_calls.py)."""
        self.calls, self.app_name, self.engine_name, self.limits = calls, app_name, engine_name, limits
        self.adapters = dict(adapters or {})
        self.tool_call_parser = tool_call_parser
        self._tool_parsing: ToolCallParsing | None = None
        self.created = int(time.time())
        self.root = app_name

    def learn_model(self, model_config: Any, max_context: int) -> None:
        vocab_size = plugin_for(model_config).model_spec(global_batch=1).vocab_size
        self.limits = dataclasses.replace(self.limits, max_context=max_context, vocab_size=vocab_size)
        self.root = served_root(model_config, self.app_name)

    def models(self, route: str) -> JSONResponse:
        card = dict(root=self.root, max_model_len=self.limits.max_context)
        if route == "v1/models":
            return JSONResponse(models_response(self.app_name, self.created, **card, adapters=self.adapters))
        wanted = route.removeprefix("v1/models/")
        adapter = check_model({"model": wanted}, self.app_name, tuple(self.adapters))
        if adapter is not None:
            card = dict(card, root=self.adapters[adapter], parent=self.app_name)
        return JSONResponse(model_card(wanted, self.created, **card))

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
        parsed = parse_completion_request(body, self.limits, model_name=self.app_name, adapters=tuple(self.adapters))
        require_supported(parsed.sampling, self.engine_name)
        runner = self.calls.require_runner()
        prompts = [prompt_tokens(prompt, runner.codec.encode) for prompt in parsed.prompts]
        # Fitted before anything is submitted: a prompt that does not fit submits none of the others.
        requests = fitted_requests(prompts, parsed, runner.engine.max_context, runner.engine.context_limit)
        echo_texts = [echo_text(prompt, tokens, fitted, runner.codec)
                      for prompt, tokens, (fitted, _) in zip(parsed.prompts, prompts, requests)] \
            if parsed.sampling.echo else []
        choices = fan_out(requests, echo_texts)
        shaper = AnswerShaper(choices, chat=False, codec=runner.codec, echo=parsed.sampling.echo,
                              echo_only=parsed.max_tokens == 0)
        return await self._respond(runner, shaper, parsed, started)

    async def chat(self, request: Request, started: float) -> Response:
        body = await read_body(request, self.limits.max_body_bytes)
        parsed = parse_chat_request(body, self.limits, model_name=self.app_name, adapters=tuple(self.adapters),
                                    parses_tool_calls=self.tool_call_parser is not None)
        require_supported(parsed.sampling, self.engine_name)
        runner = self.calls.require_runner()
        tool_calls = None
        if parsed.tool_fields is not None:
            tool_calls = self._tool_call_parsing(runner).request(parsed.tool_fields, self.app_name)
            parsed = dataclasses.replace(parsed, sampling=tool_calls.sampling(parsed.sampling))
        prompts = [chat_prompt_tokens(runner.codec, parsed.messages, parsed.tools)]
        choices = fan_out(fitted_requests(prompts, parsed, runner.engine.max_context, runner.engine.context_limit))
        return await self._respond(runner, AnswerShaper(choices, chat=True, codec=runner.codec, tool_calls=tool_calls),
                                   parsed, started)

    def _tool_call_parsing(self, runner: EngineRunner) -> ToolCallParsing:
        """The parser class, built on first use for the served tokenizer."""
        if self._tool_parsing is None:
            # serve() took the option for a Hugging Face model only, whose codec holds its tokenizer
            self._tool_parsing = ToolCallParsing(self.tool_call_parser, runner.codec.tokenizer, self.app_name)
        return self._tool_parsing

    async def _respond(self, runner: EngineRunner, shaper: AnswerShaper, parsed: Any, started: float) -> Response:
        choices = shaper.choices
        shape = dict(request_id=f"{'chatcmpl' if shaper.chat else 'cmpl'}-{uuid.uuid4().hex}",
                     model_name=parsed.sampling.adapter or self.app_name, created=int(time.time()))
        if not parsed.stream:
            outputs = await gather_cancelling([self.calls.complete(runner, c.prompt, c.params) for c in choices])
            self.calls.account(started)
            return JSONResponse(_whole(shape, shaper, outputs))
        streams = [self.calls.text(runner, choice.prompt, choice.params) for choice in choices]
        firsts = await first_items(streams)  # submits the requests: a full engine raises EngineFull before any byte
        events = self._stream_events(firsts, streams, shape, shaper, parsed.usage, started)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def _stream_events(self, firsts: list, streams: list[AsyncIterator[TextDelta | TextOutput]], shape: dict,
                             shaper: AnswerShaper, usage_options: UsageOptions,
                             started: float) -> AsyncIterator[bytes]:
        self.calls.count_ongoing(+1)
        pieces = merged(firsts, streams)
        chunks = _stream_chunks(pieces, shape, shaper, usage_options)
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


def echo_text(prompt: Prompt, tokens: list[int], fitted: list[int], codec: Any) -> str:
    """The text an echo puts first: the prompt's own, or its (fitted) tokens decoded."""
    if prompt.text is not None and len(fitted) == len(tokens):
        return prompt.text
    decoder = codec.decoder()
    return "".join(decoder.push(token) for token in fitted) + decoder.flush()


def _whole(shape: dict, shaper: AnswerShaper, outputs: list[TextOutput]) -> dict:
    choices = [shaper.whole(index, output) for index, output in enumerate(outputs)]
    respond = chat_response if shaper.chat else completion_response
    return respond(**shape, choices=choices, **usage_counts(shaper.choices, outputs))


async def _stream_chunks(pieces: AsyncIterator[tuple[int, TextDelta | TextOutput]], shape: dict,
                         shaper: AnswerShaper, usage_options: UsageOptions) -> AsyncIterator[bytes]:
    def counted(event: dict, index: int, completion_tokens: int) -> dict:
        if usage_options.every_chunk:
            event["usage"] = usage(len(shaper.choices[index].prompt), completion_tokens)
        return event

    if shaper.chat:
        for index in range(len(shaper.choices)):
            yield server_sent_event(counted(chat_chunk(**shape, delta={"role": "assistant", "content": ""},
                                                       finish_reason=None, index=index), index, 0))
    outputs: dict[int, TextOutput] = {}
    async for index, piece in pieces:
        if isinstance(piece, TextOutput):
            outputs[index] = piece
        fields = shaper.chunk(index, piece)
        if fields is not None:
            chunk = chat_chunk if shaper.chat else completion_chunk
            yield server_sent_event(counted(chunk(**shape, **fields), index, piece.completion_tokens))
    if usage_options.at_end:
        ended = [outputs[index] for index in sorted(outputs)]
        counts = usage_counts([shaper.choices[index] for index in sorted(outputs)], ended)
        yield server_sent_event(usage_chunk(**shape, object_name="chat.completion.chunk" if shaper.chat
                                            else "text_completion", **counts))
    yield server_sent_event("[DONE]")
