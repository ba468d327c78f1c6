"""The generate route's request validation: every malformed body maps to a 4xx with a reason (400 for a value,
as vLLM answers; 413 for a body too large), unknown fields are ignored."""

from __future__ import annotations

import json

import pytest

from baige_ray.serving.requests import GenerateRequest, RequestError, RequestLimits, parse_generate_request

LIMITS = RequestLimits(max_body_bytes=1024, max_prompt_chars=100, max_new_tokens=64, default_new_tokens=16)


def parse(payload) -> GenerateRequest:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return parse_generate_request(body, LIMITS)


def test_full_request_is_parsed():
    request = parse({"prompt": "def ", "max_new_tokens": 8, "temperature": 0.5, "seed": 3})
    assert request == GenerateRequest(prompt="def ", max_new_tokens=8, temperature=0.5, seed=3)


def test_defaults_fill_missing_optional_fields():
    request = parse({"prompt": "x"})
    assert (request.max_new_tokens, request.temperature, request.seed) == (16, LIMITS.default_temperature, None)


def test_integer_temperature_and_zero_are_accepted():
    assert parse({"prompt": "x", "temperature": 0}).temperature == 0.0
    assert parse({"prompt": "x", "temperature": 2}).temperature == 2.0


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        (b"not json", 400, "not valid JSON"),
        (b"\xff\xfe", 400, "not valid UTF-8"),
        (b"[1, 2]", 400, "JSON object"),
        (b'"text"', 400, "JSON object"),
        (b"x" * 2000, 413, "limit"),
        ({}, 400, "'prompt' is required"),
        ({"prompt": ""}, 400, "must not be empty"),
        ({"prompt": 5}, 400, "must be a string"),
        ({"prompt": "x" * 101}, 400, "101 characters"),
        ({"prompt": "x", "max_new_tokens": "8"}, 400, "must be an integer"),
        ({"prompt": "x", "max_new_tokens": 8.0}, 400, "must be an integer"),
        ({"prompt": "x", "max_new_tokens": True}, 400, "must be an integer"),
        ({"prompt": "x", "max_new_tokens": 0}, 400, "out of range"),
        ({"prompt": "x", "max_new_tokens": 65}, 400, "out of range"),
        ({"prompt": "x", "temperature": -0.1}, 400, "out of range"),
        ({"prompt": "x", "temperature": 11}, 400, "out of range"),
        ({"prompt": "x", "temperature": "hot"}, 400, "must be a number"),
        (b'{"prompt": "x", "temperature": NaN}', 400, "must be a number"),
        (b'{"prompt": "x", "temperature": Infinity}', 400, "out of range"),
        ({"prompt": "x", "seed": -1}, 400, "'seed'"),
        ({"prompt": "x", "seed": 1.5}, 400, "'seed'"),
    ],
)
def test_malformed_requests_are_refused_with_a_reason(body, status, words):
    with pytest.raises(RequestError) as caught:
        parse(body)
    assert caught.value.status == status
    assert words in caught.value.reason


def test_unknown_fields_are_ignored_and_null_means_the_default():
    assert parse({"prompt": "x", "top_p": 0.9, "stream": True}) == parse({"prompt": "x"})
    nulls = dict.fromkeys(["max_new_tokens", "temperature", "seed", "truncate_prompt_tokens"])
    assert parse({"prompt": "x", **nulls}) == parse({"prompt": "x"})


def test_a_refused_field_is_named():
    with pytest.raises(RequestError) as caught:
        parse({"prompt": "x", "max_new_tokens": 0})
    assert caught.value.param == "max_new_tokens"


def test_limits_are_validated():
    with pytest.raises(ValueError, match="default_new_tokens"):
        RequestLimits(max_new_tokens=8, default_new_tokens=9)
    with pytest.raises(ValueError, match="max_prompt_chars"):
        RequestLimits(max_prompt_chars=0)
