"""The generate route's request schema: parse and validate a JSON body without Ray or torch.

Every way a body can be wrong maps to a `RequestError` carrying the HTTP status and a reason
the client can act on; the server turns it into a 4xx JSON response instead of a crash.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from baige_ray.api.validation import require_int

_FIELDS = ("prompt", "max_new_tokens", "temperature", "seed", "truncate_prompt_tokens")


class RequestError(ValueError):
    """A request the server refuses; `status` is the 4xx code to answer with."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(kw_only=True, frozen=True)
class RequestLimits:
    """Bounds a generate request must respect (they bound a replica's memory and time per request)."""

    max_body_bytes: int = 64 * 1024
    max_prompt_chars: int = 4096
    max_new_tokens: int = 256
    default_new_tokens: int = 32
    max_temperature: float = 10.0
    default_temperature: float = 0.8

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_prompt_chars", "max_new_tokens", "default_new_tokens"):
            require_int("RequestLimits", name, getattr(self, name), minimum=1)
        if self.default_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"RequestLimits.default_new_tokens={self.default_new_tokens!r} is invalid: "
                f"expected at most max_new_tokens={self.max_new_tokens}"
            )
        if not 0 <= self.default_temperature <= self.max_temperature:
            raise ValueError(
                f"RequestLimits.default_temperature={self.default_temperature!r} is invalid: "
                f"expected a number in [0, max_temperature={self.max_temperature}]"
            )


@dataclass(kw_only=True, frozen=True)
class GenerateRequest:
    prompt: str
    max_new_tokens: int
    temperature: float
    seed: int | None = None
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (vLLM's extension)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def decode_json_object(body: bytes, max_body_bytes: int) -> dict:
    """The JSON object in a UTF-8 body of at most `max_body_bytes`, or a RequestError saying what is wrong."""
    if len(body) > max_body_bytes:
        raise RequestError(413, f"the body holds {len(body)} bytes, more than the limit of {max_body_bytes}")
    try:
        # Decoded explicitly: json.loads(bytes) would also guess UTF-16 and UTF-32.
        payload = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise RequestError(400, f"the body is not valid UTF-8: {error}") from None
    except json.JSONDecodeError as error:
        raise RequestError(400, f"the body is not valid JSON: {error}") from None
    except RecursionError:
        raise RequestError(400, "the body's JSON is nested too deeply") from None
    if not isinstance(payload, dict):
        raise RequestError(400, f"the body must be a JSON object, got {type(payload).__name__}")
    return payload


async def read_body(request, max_body_bytes: int) -> bytes:
    """A Starlette request's body, refused with a 413 as soon as it is known to exceed the limit
    (from Content-Length, or while streaming in), so an oversized body is never held whole."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        raise RequestError(413, f"the body holds {declared} bytes, more than the limit of {max_body_bytes}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body_bytes:
            raise RequestError(413, f"the body holds more than the limit of {max_body_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _prompt(payload: dict, limits: RequestLimits) -> str:
    if "prompt" not in payload:
        raise RequestError(422, "'prompt' is required: a non-empty string")
    return check_prompt(payload["prompt"], limits.max_prompt_chars)


def check_prompt(prompt: Any, max_chars: int) -> str:
    """A non-empty string of at most `max_chars` characters, or a 422 saying what it is instead."""
    if not isinstance(prompt, str):
        raise RequestError(422, f"'prompt' must be a string, got {type(prompt).__name__}")
    if not prompt:
        raise RequestError(422, "'prompt' must not be empty")
    if len(prompt) > max_chars:
        raise RequestError(422, f"'prompt' holds {len(prompt)} characters, more than {max_chars}")
    return prompt


def check_token_count(name: str, value: Any, maximum: int) -> int:
    """An integer in [1, maximum] (how many tokens to generate), or a 422 naming the field."""
    if not is_int(value):
        raise RequestError(422, f"'{name}' must be an integer, got {value!r}")
    if not 1 <= value <= maximum:
        raise RequestError(422, f"'{name}'={value} is out of range: expected 1 to {maximum}")
    return value


def seed_of(payload: dict) -> int | None:
    value = payload.get("seed")
    if value is not None and (not is_int(value) or not 0 <= value < 2**63):
        raise RequestError(422, f"'seed' must be an integer in [0, 2**63), got {value!r}")
    return value


def truncate_prompt_tokens_of(payload: dict) -> int | None:
    """vLLM's `truncate_prompt_tokens`: how many of the prompt's last tokens to keep (None: all of them)."""
    value = payload.get("truncate_prompt_tokens")
    if value is not None and (not is_int(value) or value < 1):
        raise RequestError(422, f"'truncate_prompt_tokens' must be a positive integer, got {value!r}")
    return value


def _max_new_tokens(payload: dict, limits: RequestLimits) -> int:
    return check_token_count("max_new_tokens", payload.get("max_new_tokens", limits.default_new_tokens),
                             limits.max_new_tokens)


def _temperature(payload: dict, limits: RequestLimits) -> float:
    value = payload.get("temperature", limits.default_temperature)
    if not is_number(value) or value != value:  # value != value: NaN
        raise RequestError(422, f"'temperature' must be a number, got {value!r}")
    if not 0 <= value <= limits.max_temperature:
        raise RequestError(422, f"'temperature'={value} is out of range: expected 0 to {limits.max_temperature}")
    return float(value)


def parse_generate_request(body: bytes, limits: RequestLimits) -> GenerateRequest:
    """The validated request in `body`, or a RequestError naming what is wrong."""
    payload = decode_json_object(body, limits.max_body_bytes)
    unknown = sorted(set(payload) - set(_FIELDS))
    if unknown:
        raise RequestError(422, f"unknown fields {unknown}: expected only {list(_FIELDS)}")
    return GenerateRequest(
        prompt=_prompt(payload, limits),
        max_new_tokens=_max_new_tokens(payload, limits),
        temperature=_temperature(payload, limits),
        seed=seed_of(payload),
        truncate_prompt_tokens=truncate_prompt_tokens_of(payload),
    )
