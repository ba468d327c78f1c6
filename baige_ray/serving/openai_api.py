"""OpenAI-compatible `/v1/completions` and `/v1/models`: parse request bodies and shape responses
(whole, or streamed as server-sent events), without Ray or torch. Chat is in openai_chat.py.

The server accepts every field OpenAI's client may send, but only at values it can honour:
features it does not implement (several choices, nucleus sampling, penalties, logprobs, echo)
are refused with a 422 that says so rather than silently ignored. An explicit JSON null
means "the default", as it does for OpenAI. Every refusal is a `RequestError` carrying the HTTP
status; `error_body` turns it into OpenAI's error shape.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from baige_ray.api.validation import require_int, require_number
from baige_ray.serving.requests import (
    RequestError, check_prompt, check_token_count, decode_json_object, is_number, seed_of, truncate_prompt_tokens_of,
)

_FIELDS = (
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "user",
    "echo",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "truncate_prompt_tokens",  # vLLM's extension: keep only the prompt's last k tokens
)
DEFAULT_MAX_TOKENS = 16
DEFAULT_TEMPERATURE = 1.0
MAX_STOP_STRINGS = 4
FINISH_REASONS = ("stop", "length")


@dataclass(kw_only=True, frozen=True)
class CompletionLimits:
    """Bounds a completion request must respect (they bound a replica's memory and time per request)."""

    max_body_bytes: int = 64 * 1024
    max_prompt_chars: int = 16384
    max_tokens: int = 512
    max_temperature: float = 10.0

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_prompt_chars", "max_tokens"):
            require_int("CompletionLimits", name, getattr(self, name), minimum=1)
        require_number("CompletionLimits", "max_temperature", self.max_temperature, minimum=0)
        if not math.isfinite(self.max_temperature):
            raise ValueError(
                f"CompletionLimits.max_temperature={self.max_temperature!r} is invalid: expected a finite number"
            )


@dataclass(kw_only=True, frozen=True)
class CompletionRequest:
    prompt: str
    max_tokens: int
    temperature: float
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the token counts
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (vLLM's extension)


def _check_fields(payload: dict) -> None:
    unknown = sorted(set(payload) - set(_FIELDS))
    if unknown:
        raise RequestError(422, f"unknown fields {unknown}: this server supports only {list(_FIELDS)}")


def _check_model(payload: dict, model_name: str) -> None:
    model = payload.get("model")
    if model is not None and model != model_name:
        raise RequestError(404, f"The model {model!r} does not exist: this server serves {model_name!r}")


def _prompt(payload: dict, limits: CompletionLimits) -> str:
    if payload.get("prompt") is None:
        raise RequestError(422, "'prompt' is required: a non-empty string")
    prompt = payload["prompt"]
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise RequestError(
                422, "'prompt' as a list must hold exactly one string: batches and token ids are not supported"
            )
        prompt = prompt[0]
    return check_prompt(prompt, limits.max_prompt_chars)


def _max_tokens(payload: dict, limits: CompletionLimits, field: str = "max_tokens") -> int:
    value = payload.get(field)
    if value is None:
        # OpenAI's default, unless the server's limit is lower.
        return min(DEFAULT_MAX_TOKENS, limits.max_tokens)
    return check_token_count(field, value, limits.max_tokens)


def _temperature(payload: dict, limits: CompletionLimits) -> float:
    value = payload.get("temperature")
    if value is None:
        return min(DEFAULT_TEMPERATURE, limits.max_temperature)
    if not is_number(value) or not math.isfinite(value):
        raise RequestError(422, f"'temperature' must be a finite number, got {value!r}")
    if not 0 <= value <= limits.max_temperature:
        raise RequestError(422, f"'temperature'={value} is out of range: expected 0 to {limits.max_temperature}")
    return float(value)


def _stop(payload: dict) -> tuple[str, ...]:
    value = payload.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(stop, str) for stop in stops):
        raise RequestError(422, f"'stop' must be a string or a list of strings, got {value!r}")
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError(422, f"'stop' holds {len(stops)} strings, more than {MAX_STOP_STRINGS}")
    if "" in stops:
        raise RequestError(422, "'stop' strings must not be empty")
    return tuple(stops)


def _require_default(payload: dict, field: str, allowed: tuple[Any, ...], reason: str) -> None:
    value = payload.get(field)
    # Compared by type as well as value: True == 1 and 0 == False in Python.
    if value is not None and not any(type(value) is type(ok) and value == ok for ok in allowed):
        raise RequestError(422, f"'{field}'={value!r}: {reason}")


def _check_unsupported(payload: dict) -> None:
    _require_default(payload, "top_p", (1, 1.0), "top_p is not supported; omit it or send 1")
    _require_default(payload, "n", (1,), "only one choice per request is supported; omit 'n' or send 1")
    _require_default(payload, "echo", (False,), "echo is not supported; omit it or send false")
    _require_default(payload, "logprobs", (False,), "logprobs are not supported; omit them or send null")
    for penalty in ("presence_penalty", "frequency_penalty"):
        _require_default(payload, penalty, (0, 0.0), f"{penalty} is not supported; omit it or send 0")
    user = payload.get("user")
    if user is not None and not isinstance(user, str):
        raise RequestError(422, f"'user' must be a string, got {type(user).__name__}")


def _stream(payload: dict) -> tuple[bool, bool]:
    """(stream, include_usage) from 'stream' and 'stream_options'."""
    stream, options = payload.get("stream"), payload.get("stream_options")
    if stream is not None and not isinstance(stream, bool):
        raise RequestError(422, f"'stream' must be true or false, got {stream!r}")
    if options is None:
        return bool(stream), False
    if not stream:
        raise RequestError(422, "'stream_options' is only allowed with stream=true")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise RequestError(422, f"'stream_options' must be an object with only 'include_usage', got {options!r}")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise RequestError(422, f"'stream_options.include_usage' must be true or false, got {include_usage!r}")
    return True, include_usage


def parse_completion_request(body: bytes, limits: CompletionLimits, *, model_name: str) -> CompletionRequest:
    """The validated completion request in `body`, or a RequestError naming what is wrong."""
    payload = decode_json_object(body, limits.max_body_bytes)
    _check_fields(payload)
    _check_model(payload, model_name)
    prompt = _prompt(payload, limits)
    _check_unsupported(payload)
    stream, include_usage = _stream(payload)
    return CompletionRequest(
        prompt=prompt,
        max_tokens=_max_tokens(payload, limits),
        temperature=_temperature(payload, limits),
        seed=seed_of(payload),
        stop=_stop(payload),
        stream=stream,
        include_usage=include_usage,
        truncate_prompt_tokens=truncate_prompt_tokens_of(payload),
    )


def apply_stop(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    """`text` cut before the earliest occurrence of any stop string, and whether one occurred."""
    cuts = [index for index in (text.find(s) for s in stop if s) if index >= 0]
    if not cuts:
        return text, False
    return text[: min(cuts)], True


class StopScanner:
    """Cuts streamed text at the first stop string, holding back a tail that may be a stop's beginning."""

    def __init__(self, stop: tuple[str, ...]):
        self.stop, self.text, self.sent, self.stopped = stop, "", 0, False
        self._hold = max((len(s) for s in stop), default=1) - 1

    def push(self, delta: str) -> str:
        """The text now safe to send; after a stop string appeared (`stopped`), nothing more."""
        if self.stopped:
            return ""
        self.text += delta
        cut, self.stopped = apply_stop(self.text, self.stop)
        end = len(cut) if self.stopped else max(self.sent, len(self.text) - self._hold)
        out, self.sent = self.text[self.sent:end], end
        return out

    def flush(self) -> str:
        """What is held back, once the output has ended without a stop string."""
        if self.stopped:
            return ""
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_chunk(*, request_id: str, model_name: str, created: int, text: str,
                     finish_reason: str | None) -> dict:
    """One server-sent event of a streamed completion."""
    return {"id": request_id, "object": "text_completion", "created": created, "model": model_name,
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}]}


def usage_chunk(*, request_id: str, model_name: str, created: int, object_name: str, prompt_tokens: int,
                completion_tokens: int) -> dict:
    """The last event when stream_options.include_usage is set: no choices, the token counts."""
    return {"id": request_id, "object": object_name, "created": created, "model": model_name, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def server_sent_event(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


def models_response(model_name: str, created: int) -> dict:
    """`GET /v1/models`: the one model this application serves."""
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                         "owned_by": "baige-ray"}]}


def completion_response(
    *,
    request_id: str,
    model_name: str,
    created: int,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
) -> dict:
    """The JSON body OpenAI's `/v1/completions` answers with, for one choice."""
    if finish_reason not in FINISH_REASONS:
        raise ValueError(f"finish_reason={finish_reason!r} is invalid: expected one of {FINISH_REASONS}")
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model_name,
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def error_body(status: int, reason: str) -> dict:
    """OpenAI's error shape; its clients read `error.message` and raise by status."""
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    return {"error": {"message": reason, "type": kind, "code": status}}
