"""Tool calls read from a chat answer, as `vllm serve --enable-auto-tool-choice --tool-call-parser NAME` reads them.

`serve(engine="vllm", tool_call_parser=NAME)` puts vLLM's own parser of that name (its ParserManager) into each
replica, and every chat request goes through it the way vLLM's chat serving layer takes it: the request as
vLLM's `ChatCompletionRequest`; for a tool choice other than "none", the parser's `adjust_request` (which may
constrain the answer with a structural tag, and keep special tokens in its text); then the answer through
`parse` (whole) or `parse_delta` (each streamed piece, one parser per choice). What comes out is shaped as
vLLM shapes it: a named or "required" choice carries `tool_calls` (content "" when none), "auto" carries them
when the model called a tool; the finish reason is "tool_calls" for "auto" with calls, and for "required" that
stopped ("stop" for a named choice); `parallel_tool_calls: false` keeps the first call only. Tool call ids are
drawn at random, as vLLM draws them.

The built-in engine has no grammar-constrained sampler, so `tool_call_parser` is refused with it (serve()), and
a request asking for a tool call from it gets a 400 naming the option (openai_tools.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from baige_ray.serving.requests import bad_request
from baige_ray.serving.sampling_params import SamplingParams

# The fields of a chat request vLLM's request model needs to decide on tools and their grammar.
TOOL_REQUEST_FIELDS = ("messages", "tools", "tool_choice", "parallel_tool_calls", "response_format",
                       "structured_outputs", "skip_special_tokens")


def registered_tool_parsers() -> list[str]:
    """The tool-call parsers the installed vLLM knows by name (`--tool-call-parser`'s choices)."""
    from vllm.tool_parsers import ToolParserManager

    return ToolParserManager.list_registered()


def check_tool_call_parser(name: str) -> None:
    """A ValueError naming `serve()`'s option when vLLM has no parser of that name."""
    known = registered_tool_parsers()
    if name not in known:
        raise ValueError(f"ServeOptions.tool_call_parser={name!r} is invalid: expected one of vLLM's tool-call "
                         f"parsers {known}")


class ToolCallParsing:
    """A replica's tool-call parser class, built once for its tokenizer; `request` starts a chat request's."""

    def __init__(self, name: str, tokenizer: Any, model_name: str):
        from vllm.parser.parser_manager import ParserManager

        self.name, self.tokenizer = name, tokenizer
        self.parser_cls = ParserManager.get_parser(tool_parser_name=name, enable_auto_tools=True,
                                                   model_name=model_name, tokenizer=tokenizer)

    def request(self, fields: dict, model_name: str) -> ToolCallRequest:
        """The chat request's tool calling (its fields: TOOL_REQUEST_FIELDS); a 400 where vLLM's request
        model refuses them (a named tool the request did not send, for one)."""
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        try:
            request = ChatCompletionRequest.model_validate({**fields, "model": model_name})
        except ValidationError as error:
            problems = error.errors()
            field = next((str(e["loc"][0]) for e in problems if e.get("loc")), "tool_choice")
            raise bad_request(field, "; ".join(e["msg"] for e in problems)) from None
        adjusted = request.tool_choice != "none"  # vLLM adjusts no request that asks for no tool call
        if adjusted:
            request = self.new_parser(request).adjust_request(request)
        return ToolCallRequest(self, request, adjusted)

    def new_parser(self, request: Any) -> Any:
        return self.parser_cls(self.tokenizer, request.tools, model_config=None, chat_template_kwargs={})


@dataclass
class ToolCallRequest:
    """One chat request's tool calling: what it asks of sampling, and its answers read back."""

    parsing: ToolCallParsing
    request: Any  # vLLM's ChatCompletionRequest, adjusted by the parser
    adjusted: bool  # whether the parser adjusted it (every tool choice but "none")

    def sampling(self, params: SamplingParams) -> SamplingParams:
        """`params` with what the parser asked of sampling: its grammar, and special tokens kept in the text."""
        structured = self._structured_outputs() if self.adjusted else None
        return dataclasses.replace(params, structured_outputs=structured or params.structured_outputs,
                                   skip_special_tokens=bool(self.request.skip_special_tokens))

    def _structured_outputs(self) -> str | None:
        """The grammar the parser set (StructuredOutputsParams keyword arguments as JSON), or None."""
        params = self.request.structured_outputs
        if params is None:
            return None
        from baige_ray.serving.structured_output import canonical_structured_outputs

        return canonical_structured_outputs(params)

    @property
    def named(self) -> bool:
        """Whether the request named the function to call (its finish reason stays "stop", as OpenAI's)."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionNamedToolChoiceParam

        return isinstance(self.request.tool_choice, ChatCompletionNamedToolChoiceParam)

    @property
    def required(self) -> bool:
        return self.request.tool_choice == "required"

    def whole(self, text: str, token_ids: tuple[int, ...], finish_reason: str,
              prompt_token_ids: list[int] = ()) -> tuple[dict, str]:
        """The answer's message and finish reason, as vLLM's chat serving layer builds them."""
        parser = self.parsing.new_parser(self.request)
        parser.set_prompt_token_ids(list(prompt_token_ids))
        _, content, calls = parser.parse(text, self.request, enable_auto_tools=True, model_output_token_ids=token_ids)
        message: dict = {"role": "assistant", "content": content}
        called = False
        if self.named or self.required:
            message["content"] = content or ""
        elif self.request.tool_choice not in (None, "none") and self.request.tools and calls:
            called = True
        else:
            calls = []
        if calls:  # vLLM's message leaves an empty list of calls out
            message["tool_calls"] = [_tool_call(call) for call in calls]
        if self.request.parallel_tool_calls is False and message.get("tool_calls"):
            message["tool_calls"] = message["tool_calls"][:1]
        if called or (self.required and finish_reason == "stop"):
            finish_reason = "tool_calls"
        return message, finish_reason

    def stream(self, prompt_token_ids: list[int] = ()) -> ToolCallStream:
        """A reader of one choice's streamed answer."""
        return ToolCallStream(self, self.parsing.new_parser(self.request), list(prompt_token_ids))


@dataclass
class ToolCallStream:
    """One choice's streamed answer read piece by piece (a parser keeps state between pieces)."""

    calls: ToolCallRequest
    parser: Any
    prompt_token_ids: list[int]
    called: bool = False

    def delta(self, text: str, token_ids: tuple[int, ...], finished: bool) -> dict | None:
        """The piece's `delta` as vLLM streams it (None: nothing to send yet)."""
        message = self.parser.parse_delta(delta_text=text, delta_token_ids=list(token_ids),
                                          request=self.calls.request, prompt_token_ids=self.prompt_token_ids,
                                          finished=finished)
        if message is None:
            return None
        delta = message.model_dump(exclude_unset=True)
        if delta.get("tool_calls"):
            self.called = True
            if self.calls.request.parallel_tool_calls is False:
                delta["tool_calls"] = [call for call in delta["tool_calls"] if call.get("index") == 0]
        return delta

    def finish_reason(self, reason: str) -> str:
        """vLLM's: "tool_calls" when a streamed call ended with "stop", unless the choice named the tool."""
        return "tool_calls" if self.called and not self.calls.named and reason == "stop" else reason


def _tool_call(call: Any) -> dict:
    """One entry of a message's `tool_calls` (OpenAI's shape) from the parser's FunctionCall."""
    from vllm.renderers.chat_utils import make_tool_call_id

    return {"id": call.id or make_tool_call_id(), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def tool_request_fields(payload: dict) -> dict:
    """The chat request's fields vLLM's request model reads for tool calling (those it sent)."""
    return {key: payload[key] for key in TOOL_REQUEST_FIELDS if key in payload}
