"""OpenAI-compatible `/v1/chat/completions`: parse a request body and shape responses, without Ray or torch.

Messages are `{"role": "system" | "user" | "assistant", "content": str}` (content may also be a list
of text parts). They become one prompt through the model's chat template (`TextCodec.chat_prompt`).
Sampling fields are checked exactly as for completions (openai_api.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from baige_ray.serving.openai_api import (
    FINISH_REASONS,
    CompletionLimits,
    _check_model,
    _check_unsupported,
    _max_tokens,
    _stop,
    _stream,
    _temperature,
    usage,
)
from baige_ray.serving.requests import RequestError, decode_json_object, seed_of, truncate_prompt_tokens_of

_FIELDS = (
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
    "stream_options", "stop", "seed", "user", "logprobs", "presence_penalty", "frequency_penalty",
    "truncate_prompt_tokens",
)
ROLES = ("system", "user", "assistant")
MAX_MESSAGES = 256


@dataclass(kw_only=True, frozen=True)
class ChatRequest:
    messages: tuple[tuple[str, str], ...]  # (role, content)
    max_tokens: int
    temperature: float
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (vLLM's extension)


def _content(index: int, content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text"
                                         and isinstance(part.get("text"), str) for part in content):
        return "".join(part["text"] for part in content)
    raise RequestError(422, f"messages[{index}].content must be a string or a list of text parts")


def _messages(payload: dict, limits: CompletionLimits) -> tuple[tuple[str, str], ...]:
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(422, "'messages' is required: a non-empty list of {role, content} objects")
    if len(messages) > MAX_MESSAGES:
        raise RequestError(422, f"'messages' holds {len(messages)} messages, more than {MAX_MESSAGES}")
    parsed = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise RequestError(422, f"messages[{index}] must be an object with 'role' and 'content'")
        if message["role"] not in ROLES:
            raise RequestError(422, f"messages[{index}].role={message['role']!r}: expected one of {list(ROLES)}")
        extra = sorted(set(message) - {"role", "content", "name"})
        if extra:
            raise RequestError(422, f"messages[{index}] has unsupported fields {extra}")
        parsed.append((message["role"], _content(index, message["content"])))
    total = sum(len(content) for _, content in parsed)
    if total > limits.max_prompt_chars:
        raise RequestError(422, f"the messages hold {total} characters, more than {limits.max_prompt_chars}")
    if not any(content for _, content in parsed):
        raise RequestError(422, "every message is empty: send some text")
    return tuple(parsed)


def parse_chat_request(body: bytes, limits: CompletionLimits, *, model_name: str) -> ChatRequest:
    """The validated chat request in `body`, or a RequestError naming what is wrong."""
    payload = decode_json_object(body, limits.max_body_bytes)
    unknown = sorted(set(payload) - set(_FIELDS))
    if unknown:
        raise RequestError(422, f"unknown fields {unknown}: this server supports only {list(_FIELDS)}")
    _check_model(payload, model_name)
    messages = _messages(payload, limits)
    _check_unsupported(payload)
    if payload.get("max_tokens") is not None and payload.get("max_completion_tokens") is not None:
        raise RequestError(422, "send 'max_completion_tokens' or 'max_tokens', not both")
    field = "max_completion_tokens" if payload.get("max_completion_tokens") is not None else "max_tokens"
    stream, include_usage = _stream(payload)
    return ChatRequest(
        messages=messages, max_tokens=_max_tokens(payload, limits, field), temperature=_temperature(payload, limits),
        seed=seed_of(payload), stop=_stop(payload), stream=stream, include_usage=include_usage,
        truncate_prompt_tokens=truncate_prompt_tokens_of(payload),
    )


def chat_response(*, request_id: str, model_name: str, created: int, text: str, finish_reason: str,
                  prompt_tokens: int, completion_tokens: int) -> dict:
    if finish_reason not in FINISH_REASONS:
        raise ValueError(f"finish_reason={finish_reason!r} is invalid: expected one of {FINISH_REASONS}")
    return {
        "id": request_id, "object": "chat.completion", "created": created, "model": model_name,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason,
                     "logprobs": None}],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def chat_chunk(*, request_id: str, model_name: str, created: int, delta: dict, finish_reason: str | None) -> dict:
    """One server-sent event of a streamed chat completion (the first carries the role)."""
    return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model_name,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]}


