"""The generate route's request schema: parse and validate a JSON body without Ray or torch.

Every way a body can be wrong maps to a `RequestError` carrying the HTTP status (400 for a value the
server refuses, as vLLM answers; 413 for a body too large) and a reason the client can act on; the
server turns it into a 4xx JSON response instead of a crash. Fields a route does not know are
ignored, as OpenAI's and vLLM's servers ignore them (logged once per name, at debug level), and a
JSON null means the field's default.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from baige_ray.api.validation import is_int, is_number, require_int

_FIELDS = ("prompt", "max_new_tokens", "temperature", "seed", "truncate_prompt_tokens")

logger = logging.getLogger(__name__)
_LOGGED_IGNORED: set[str] = set()  # field names already logged as ignored: one line per name, not per request


class RequestError(ValueError):
    """A request the server refuses; `status` is the 4xx code to answer with, `param` the request field at
    fault where one is (OpenAI's error `param`)."""

    def __init__(self, status: int, reason: str, param: str | None = None):
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.param = param


def bad_request(field: str, reason: str) -> RequestError:
    """A 400 about the request field `field`."""
    return RequestError(400, reason, param=field)


def ignore_unknown_fields(payload: dict, known: Collection[str], route: str) -> None:
    """Log, once per field name, the fields of `payload` that `route` does not know (they are ignored)."""
    for name in sorted(set(payload) - set(known) - _LOGGED_IGNORED):
        _LOGGED_IGNORED.add(name)
        logger.debug("%s: ignoring the field %r, which this server does not read (logged once)", route, name)


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
    if payload.get("prompt") is None:
        raise bad_request("prompt", "'prompt' is required: a non-empty string")
    return check_prompt(payload["prompt"], limits.max_prompt_chars)


def check_prompt(prompt: Any, max_chars: int, field: str = "prompt") -> str:
    """A non-empty string of at most `max_chars` characters, or a 400 saying what it is instead."""
    if not isinstance(prompt, str):
        raise bad_request(field, f"'{field}' must be a string, got {type(prompt).__name__}")
    if not prompt:
        raise bad_request(field, f"'{field}' must not be empty")
    if len(prompt) > max_chars:
        raise bad_request(field, f"'{field}' holds {len(prompt)} characters, more than {max_chars}")
    return prompt


def check_token_count(name: str, value: Any, maximum: int | None) -> int:
    """An integer in [1, maximum] (how many tokens to generate; no upper bound when `maximum` is None),
    or a 400 naming the field."""
    if not is_int(value):
        raise bad_request(name, f"'{name}' must be an integer, got {value!r}")
    if value < 1 or (maximum is not None and value > maximum):
        expected = "at least 1" if maximum is None else f"1 to {maximum}"
        raise bad_request(name, f"'{name}'={value} is out of range: expected {expected}")
    return value


def seed_of(payload: dict) -> int | None:
    value = payload.get("seed")
    if value is not None and (not is_int(value) or not 0 <= value < 2**63):
        raise bad_request("seed", f"'seed' must be an integer in [0, 2**63), got {value!r}")
    return value


def truncate_prompt_tokens_of(payload: dict) -> int | None:
    """vLLM's `truncate_prompt_tokens`: how many of the prompt's last tokens to keep (None: all of them; -1:
    as many as fit the context)."""
    value = payload.get("truncate_prompt_tokens")
    if value is not None and (not is_int(value) or (value < 1 and value != -1)):
        raise bad_request("truncate_prompt_tokens",
                          f"'truncate_prompt_tokens' must be a positive integer or -1, got {value!r}")
    return value


def _max_new_tokens(payload: dict, limits: RequestLimits) -> int:
    value = payload.get("max_new_tokens")
    return check_token_count("max_new_tokens", limits.default_new_tokens if value is None else value,
                             limits.max_new_tokens)


def _temperature(payload: dict, limits: RequestLimits) -> float:
    value = payload.get("temperature")
    value = limits.default_temperature if value is None else value
    if not is_number(value) or value != value:  # value != value: NaN
        raise bad_request("temperature", f"'temperature' must be a number, got {value!r}")
    if not 0 <= value <= limits.max_temperature:
        raise bad_request("temperature",
                          f"'temperature'={value} is out of range: expected 0 to {limits.max_temperature}")
    return float(value)


def parse_generate_request(body: bytes, limits: RequestLimits) -> GenerateRequest:
    """The validated request in `body`, or a RequestError naming what is wrong."""
    payload = decode_json_object(body, limits.max_body_bytes)
    ignore_unknown_fields(payload, _FIELDS, "generate")
    return GenerateRequest(
        prompt=_prompt(payload, limits),
        max_new_tokens=_max_new_tokens(payload, limits),
        temperature=_temperature(payload, limits),
        seed=seed_of(payload),
        truncate_prompt_tokens=truncate_prompt_tokens_of(payload),
    )
