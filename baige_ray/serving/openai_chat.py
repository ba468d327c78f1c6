"""OpenAI-compatible `/v1/chat/completions`: parse a request body as vLLM's server reads it, without Ray or torch.

Messages are `{"role": ..., "content": str | [{"type": "text", "text": str}, ...] | null}`; text parts
are joined with newlines, as vLLM joins them, and other part types (images, audio) are refused
naming the type. Other message fields (`name`, `tool_calls`: null, ...) are ignored. The messages
become one prompt through the model's chat template (`TextCodec.chat_tokens`). Sampling fields are
parsed as for completions (openai_sampling.py); `max_completion_tokens` wins over the older
`max_tokens`, and a request with neither may generate up to the rest of the model's context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from baige_ray.serving.openai_api import (
    COMMON_FIELDS,
    CompletionLimits,
    UsageOptions,
    check_model,
    check_user,
    parse_max_tokens,
    parse_stream,
    refuse_unimplemented,
)
from baige_ray.serving.openai_sampling import chat_logprobs, parse_sampling
from baige_ray.serving.openai_tools import parse_tools
from baige_ray.serving.requests import bad_request, decode_json_object, ignore_unknown_fields, truncate_prompt_tokens_of
from baige_ray.serving.sampling_params import SamplingParams
from baige_ray.serving.tool_calls import tool_request_fields

CHAT_FIELDS = COMMON_FIELDS + ("messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                               "parallel_tool_calls")
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_MESSAGES = 256


@dataclass(kw_only=True, frozen=True)
class ChatRequest:
    messages: tuple[tuple[str, str], ...]  # (role, content)
    max_tokens: int | None  # None: up to the rest of the model's context, once the prompt is known
    max_tokens_field: str  # which field set it ("max_completion_tokens" or "max_tokens"), for error messages
    sampling: SamplingParams  # its max_new_tokens provisional when max_tokens is None (the replica sets it)
    stream: bool = False
    usage: UsageOptions = UsageOptions()  # stream_options: where token counts are reported
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (vLLM's extension)
    tools: tuple[dict, ...] | None = None  # rendered into the chat template (openai_tools.py)
    # What vLLM's request model reads for tool calls (serving/tool_calls.py), where the app parses them
    tool_fields: dict | None = None


def _part_text(index: int, number: int, part: Any) -> str:
    where = f"messages[{index}].content[{number}]"
    if not isinstance(part, dict):
        raise bad_request("messages", f"{where} must be an object with a 'type', got {part!r}")
    if part.get("type") != "text":
        raise bad_request("messages", f"{where} has type {part.get('type')!r}: this server takes text parts only "
                                      "(type 'text')")
    if not isinstance(part.get("text"), str):
        raise bad_request("messages", f"{where}.text must be a string")
    return part["text"]


def _content(index: int, message: dict) -> str:
    content = message.get("content")
    if content is None and message["role"] in ("assistant", "tool"):
        return ""  # an assistant turn that only called tools
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(_part_text(index, number, part) for number, part in enumerate(content))
    raise bad_request("messages", f"messages[{index}].content must be a string or a list of text parts")


def _message(index: int, message: Any) -> tuple[str, str]:
    if not isinstance(message, dict) or "role" not in message:
        raise bad_request("messages", f"messages[{index}] must be an object with 'role' and 'content'")
    if message["role"] not in ROLES:
        raise bad_request("messages", f"messages[{index}].role={message['role']!r}: expected one of {list(ROLES)}")
    return message["role"], _content(index, message)


def parse_messages(payload: dict, limits: CompletionLimits) -> tuple[tuple[str, str], ...]:
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages", "'messages' is required: a non-empty list of {role, content} objects")
    if len(messages) > MAX_MESSAGES:
        raise bad_request("messages", f"'messages' holds {len(messages)} messages, more than {MAX_MESSAGES}")
    parsed = tuple(_message(index, message) for index, message in enumerate(messages))
    total = sum(len(content) for _, content in parsed)
    if total > limits.max_prompt_chars:
        raise bad_request("messages", f"the messages hold {total} characters, more than {limits.max_prompt_chars}")
    return parsed


def _max_tokens(payload: dict, limits: CompletionLimits) -> tuple[int | None, str]:
    """vLLM's rule: `max_completion_tokens` when set, else the older `max_tokens` (None: the rest of the context)."""
    if payload.get("max_completion_tokens") is not None:
        return parse_max_tokens(payload, limits, "max_completion_tokens", None), "max_completion_tokens"
    return parse_max_tokens(payload, limits, "max_tokens", None), "max_tokens"


def parse_chat_request(body: bytes, limits: CompletionLimits, *, model_name: str,
                       adapters: tuple[str, ...] = (), parses_tool_calls: bool = False) -> ChatRequest:
    """The validated chat request in `body`, or a RequestError naming what is wrong. `parses_tool_calls`: the
    app reads tool calls from answers (serve's tool_call_parser), so every tool_choice is taken."""
    payload = decode_json_object(body, limits.max_body_bytes)
    ignore_unknown_fields(payload, CHAT_FIELDS, "v1/chat/completions")
    adapter = check_model(payload, model_name, adapters)
    refuse_unimplemented(payload)
    tools = parse_tools(payload, parses_tool_calls=parses_tool_calls)
    if payload.get("parallel_tool_calls") is not None and not isinstance(payload["parallel_tool_calls"], bool):
        raise bad_request("parallel_tool_calls", "'parallel_tool_calls' must be true or false")
    check_user(payload)
    messages = parse_messages(payload, limits)
    max_tokens, field = _max_tokens(payload, limits)
    sampling = parse_sampling(payload, limits, max_new_tokens=max_tokens, num_logprobs=chat_logprobs(payload),
                              logprobs_field="top_logprobs", adapter=adapter)
    stream, usage = parse_stream(payload)
    return ChatRequest(messages=messages, max_tokens=max_tokens, max_tokens_field=field, sampling=sampling,
                       stream=stream, usage=usage, tools=tools,
                       truncate_prompt_tokens=truncate_prompt_tokens_of(payload),
                       tool_fields=tool_request_fields(payload) if parses_tool_calls else None)
