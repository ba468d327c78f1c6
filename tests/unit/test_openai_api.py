"""OpenAI `/v1/completions` shapes: every malformed or unsupported body maps to a 4xx with a reason."""

from __future__ import annotations

import json

import pytest

from baige_ray.serving.openai_api import (
    CompletionLimits,
    CompletionRequest,
    apply_stop,
    completion_response,
    error_body,
    parse_completion_request,
)
from baige_ray.serving.requests import RequestError

LIMITS = CompletionLimits(max_body_bytes=1024, max_prompt_chars=100, max_tokens=64, max_temperature=2.0)
MODEL = "tiny-llama"


def parse(payload) -> CompletionRequest:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return parse_completion_request(body, LIMITS, model_name=MODEL)


def test_full_request_is_parsed():
    request = parse(
        {"model": MODEL, "prompt": "def ", "max_tokens": 8, "temperature": 0.5, "seed": 3, "stop": ["\n", "#"]}
    )
    assert request == CompletionRequest(prompt="def ", max_tokens=8, temperature=0.5, seed=3, stop=("\n", "#"))


def test_defaults_fill_missing_optional_fields():
    assert parse({"prompt": "x"}) == CompletionRequest(prompt="x", max_tokens=16, temperature=1.0, seed=None, stop=())


def test_default_max_tokens_respects_a_lower_limit():
    limits = CompletionLimits(max_tokens=4)
    assert parse_completion_request(b'{"prompt": "x"}', limits, model_name=MODEL).max_tokens == 4


def test_the_fields_openai_clients_send_at_their_defaults_are_accepted():
    request = parse(
        {
            "model": MODEL,
            "prompt": ["hello"],
            "max_tokens": 4,
            "temperature": 0,
            "top_p": 1,
            "n": 1,
            "stream": False,
            "stop": "\n",
            "seed": None,
            "user": "alice",
            "echo": False,
            "logprobs": None,
            "presence_penalty": 0,
            "frequency_penalty": 0.0,
        }
    )
    assert request == CompletionRequest(prompt="hello", max_tokens=4, temperature=0.0, seed=None, stop=("\n",))


def test_null_means_the_default():
    nulls = dict.fromkeys(["model", "max_tokens", "temperature", "top_p", "n", "stream", "stop", "seed", "user"])
    assert parse({"prompt": "x", **nulls}) == parse({"prompt": "x"})


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        (b"not json", 400, "not valid JSON"),
        (b"\xff\xfe", 400, "not valid UTF-8"),
        ('{"prompt": "x"}'.encode("utf-16"), 400, "not valid UTF-8"),
        (b"[1, 2]", 400, "JSON object"),
        (b'"text"', 400, "JSON object"),
        (b'{"prompt": "' + b"x" * 2000 + b'"}', 413, "more than the limit"),
    ],
)
def test_malformed_bodies(body, status, words):
    with pytest.raises(RequestError) as caught:
        parse(body)
    assert caught.value.status == status
    assert words in caught.value.reason


@pytest.mark.parametrize(
    ("payload", "status", "words"),
    [
        ({"prompt": "x", "max_new_tokens": 3}, 422, "unknown fields ['max_new_tokens']"),
        ({"prompt": "x", "best_of": 2}, 422, "supports only"),
        ({"prompt": "x", "model": "gpt-4"}, 404, "The model 'gpt-4' does not exist"),
        ({}, 422, "'prompt' is required"),
        ({"prompt": None}, 422, "'prompt' is required"),
        ({"prompt": 5}, 422, "must be a string"),
        ({"prompt": ""}, 422, "must not be empty"),
        ({"prompt": [""]}, 422, "must not be empty"),
        ({"prompt": ["a", "b"]}, 422, "exactly one string"),
        ({"prompt": []}, 422, "exactly one string"),
        ({"prompt": [1, 2, 3]}, 422, "exactly one string"),
        ({"prompt": "x" * 101}, 422, "101 characters"),
        ({"prompt": "x", "max_tokens": 0}, 422, "out of range"),
        ({"prompt": "x", "max_tokens": 65}, 422, "out of range"),
        ({"prompt": "x", "max_tokens": 2.5}, 422, "must be an integer"),
        ({"prompt": "x", "max_tokens": True}, 422, "must be an integer"),
        ({"prompt": "x", "temperature": -0.1}, 422, "out of range"),
        ({"prompt": "x", "temperature": 2.5}, 422, "out of range"),
        ({"prompt": "x", "temperature": "hot"}, 422, "finite number"),
        ({"prompt": "x", "top_p": 0.9}, 422, "top_p is not supported"),
        ({"prompt": "x", "n": 2}, 422, "one choice"),
        ({"prompt": "x", "stream": 1}, 422, "must be true or false"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, 422, "only allowed with stream=true"),
        ({"prompt": "x", "stream": True, "stream_options": {"x": 1}}, 422, "only 'include_usage'"),
        ({"prompt": "x", "seed": -1}, 422, "'seed'"),
        ({"prompt": "x", "seed": 2**63}, 422, "'seed'"),
        ({"prompt": "x", "seed": "7"}, 422, "'seed'"),
        ({"prompt": "x", "stop": 3}, 422, "'stop' must be"),
        ({"prompt": "x", "stop": ["a", 3]}, 422, "'stop' must be"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 422, "more than 4"),
        ({"prompt": "x", "stop": ""}, 422, "must not be empty"),
        ({"prompt": "x", "echo": True}, 422, "echo is not supported"),
        ({"prompt": "x", "logprobs": 1}, 422, "logprobs are not supported"),
        ({"prompt": "x", "logprobs": 0}, 422, "logprobs are not supported"),
        ({"prompt": "x", "logprobs": True}, 422, "logprobs are not supported"),
        ({"prompt": "x", "user": 7}, 422, "'user' must be a string"),
        ({"prompt": "x", "presence_penalty": 0.5}, 422, "presence_penalty is not supported"),
        ({"prompt": "x", "frequency_penalty": -1}, 422, "frequency_penalty is not supported"),
    ],
)
def test_invalid_fields(payload, status, words):
    with pytest.raises(RequestError) as caught:
        parse(payload)
    assert caught.value.status == status
    assert words in caught.value.reason


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_temperature_is_refused(value):
    with pytest.raises(RequestError) as caught:
        parse(b'{"prompt": "x", "temperature": ' + value.encode() + b"}")
    assert caught.value.status == 422


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_body_bytes", 0),
        ("max_prompt_chars", 1.5),
        ("max_tokens", True),
        ("max_temperature", -1.0),
        ("max_temperature", float("inf")),
        ("max_temperature", "2"),
    ],
)
def test_invalid_limits_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"CompletionLimits.{field}"):
        CompletionLimits(**{field: value})


def test_default_limits():
    limits = CompletionLimits()
    assert (limits.max_body_bytes, limits.max_prompt_chars, limits.max_tokens, limits.max_temperature) == (
        65536,
        16384,
        512,
        10.0,
    )


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("hello\nworld", ("\n",), ("hello", True)),
        ("a#b\nc", ("\n", "#"), ("a", True)),
        ("abc", ("x",), ("abc", False)),
        ("abc", (), ("abc", False)),
        ("stop", ("stop",), ("", True)),
        ("xxENDyyEND", ("END",), ("xx", True)),
    ],
)
def test_apply_stop_cuts_at_the_earliest_stop(text, stop, expected):
    assert apply_stop(text, stop) == expected


def test_completion_response_has_openai_shape():
    body = completion_response(
        request_id="cmpl-1",
        model_name=MODEL,
        created=1700000000,
        text=" world",
        finish_reason="length",
        prompt_tokens=3,
        completion_tokens=2,
    )
    assert body == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1700000000,
        "model": MODEL,
        "choices": [{"index": 0, "text": " world", "finish_reason": "length", "logprobs": None}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }
    assert json.loads(json.dumps(body)) == body


def test_completion_response_refuses_unknown_finish_reasons():
    with pytest.raises(ValueError, match="finish_reason"):
        completion_response(
            request_id="x",
            model_name=MODEL,
            created=0,
            text="",
            finish_reason="eos",
            prompt_tokens=1,
            completion_tokens=0,
        )


def test_error_body_has_openai_shape():
    assert error_body(422, "top_p is not supported") == {
        "error": {"message": "top_p is not supported", "type": "invalid_request_error", "code": 422}
    }
    assert error_body(404, "no model")["error"]["type"] == "invalid_request_error"
    assert error_body(500, "boom")["error"]["type"] == "server_error"
