"""OpenAI `/v1/completions` parsing as vLLM's server reads a request: unknown fields ignored, null as the
default, every prompt shape, the sampling fields carried, and every refusal a 4xx naming the field."""

from __future__ import annotations

import json
import logging

import pytest

from baige_ray.serving import requests as requests_module
from baige_ray.serving.openai_api import CompletionLimits, CompletionRequest, apply_stop, parse_completion_request
from baige_ray.serving.openai_prompts import Prompt
from baige_ray.serving.openai_responses import completion_choice, completion_chunk, completion_response, error_body
from baige_ray.serving.requests import RequestError
from baige_ray.serving.sampling_params import SamplingParams

LIMITS = CompletionLimits(max_body_bytes=1024, max_prompt_chars=100, max_temperature=2.0, max_context=64,
                          vocab_size=50)
MODEL = "tiny-llama"


def parse(payload, limits: CompletionLimits = LIMITS) -> CompletionRequest:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return parse_completion_request(body, limits, model_name=MODEL)


def test_full_request_is_parsed():
    request = parse({"model": MODEL, "prompt": "def ", "max_tokens": 8, "temperature": 0.5, "seed": 3,
                     "stop": ["\n", "#"]})
    assert request == CompletionRequest(
        prompts=(Prompt(text="def "),), max_tokens=8,
        sampling=SamplingParams(max_new_tokens=8, temperature=0.5, seed=3, stop=("\n", "#")))


def test_defaults_fill_missing_optional_fields():
    request = parse({"prompt": "x"})
    assert request.max_tokens == 16 and request.sampling == SamplingParams(max_new_tokens=16, temperature=1.0)
    assert request.sampling.top_k is None  # no hidden top-k: the whole vocabulary, as vLLM samples


def test_vllm_bench_serve_request_is_accepted():
    """What `vllm bench serve --backend openai --ignore-eos` sends for every request."""
    request = parse({"model": MODEL, "prompt": "hello", "repetition_penalty": 1.0, "max_tokens": 8, "logprobs": None,
                     "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                     "ignore_eos": True})
    assert (request.stream, request.usage.at_end, request.sampling.ignore_eos) == (True, True, True)


def test_unknown_fields_are_ignored_and_logged_once_per_name(caplog, monkeypatch):
    monkeypatch.setattr(requests_module, "_LOGGED_IGNORED", set())
    with caplog.at_level(logging.DEBUG, logger="baige_ray.serving.requests"):
        for _ in range(3):
            assert parse({"prompt": "x", "best_of": 2, "max_new_tokens": 3}) == parse({"prompt": "x"})
    logged = [record.getMessage() for record in caplog.records]
    assert sum("'best_of'" in line for line in logged) == 1 and sum("'max_new_tokens'" in line for line in logged) == 1


def test_null_means_the_default():
    fields = ["model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stream", "stream_options",
              "stop", "stop_token_ids", "seed", "user", "echo", "logprobs", "presence_penalty", "frequency_penalty",
              "repetition_penalty", "logit_bias", "min_tokens", "ignore_eos", "include_stop_str_in_output",
              "truncate_prompt_tokens", "suffix", "use_beam_search", "response_format"]
    assert parse({"prompt": "x", **dict.fromkeys(fields)}) == parse({"prompt": "x"})


@pytest.mark.parametrize(("prompt", "expected"), [
    ("hello", (Prompt(text="hello"),)),
    (["a", "b"], (Prompt(text="a"), Prompt(text="b"))),
    ([1, 2, 49], (Prompt(token_ids=(1, 2, 49)),)),
    ([[1, 2], [0]], (Prompt(token_ids=(1, 2)), Prompt(token_ids=(0,)))),
])
def test_every_prompt_shape_vllm_takes(prompt, expected):
    assert parse({"prompt": prompt}).prompts == expected


def test_token_ids_are_not_bounded_when_the_vocabulary_is_unknown():
    assert parse({"prompt": [10_000]}, CompletionLimits()).prompts == (Prompt(token_ids=(10_000,)),)


def test_the_sampling_fields_are_carried():
    request = parse({"prompt": "x", "max_tokens": 10, "top_k": 5, "top_p": 0.9, "min_p": 0.05, "presence_penalty": 0.5,
                     "frequency_penalty": -0.5, "repetition_penalty": 1.2, "logit_bias": {"7": 3, "2": -500},
                     "min_tokens": 2, "ignore_eos": True, "stop": ["a", "b", "c", "d", "e", "a"],
                     "stop_token_ids": [4, 4, 9], "include_stop_str_in_output": True, "n": 2, "logprobs": 3,
                     "echo": True, "seed": 11})
    assert request.sampling == SamplingParams(
        max_new_tokens=10, temperature=1.0, top_k=5, top_p=0.9, min_p=0.05, presence_penalty=0.5,
        frequency_penalty=-0.5, repetition_penalty=1.2, logit_bias=((2, -100.0), (7, 3.0)), min_tokens=2,
        ignore_eos=True, stop=("a", "b", "c", "d", "e"), stop_token_ids=(4, 9), include_stop_str_in_output=True,
        n=2, num_logprobs=3, prompt_logprobs=3, echo=True, seed=11)  # echo's prompt log-probabilities, as vLLM's


@pytest.mark.parametrize(("top_k", "expected"), [(-1, None), (0, None), (1, 1), (40, 40)])
def test_top_k_minus_one_or_zero_is_off_as_in_vllm(top_k, expected):
    assert parse({"prompt": "x", "top_k": top_k}).sampling.top_k == expected


@pytest.mark.parametrize(("logprobs", "expected"), [(False, None), (True, 1), (0, 0), (5, 5), (20, 20)])
def test_logprobs_is_how_many_per_position(logprobs, expected):
    assert parse({"prompt": "x", "logprobs": logprobs}).sampling.num_logprobs == expected


def test_logprobs_beyond_the_servers_max_logprobs_are_refused_as_vllm_refuses_them():
    for logprobs, wanted in ((21, 21), (-1, 50)):  # -1: the whole vocabulary of 50
        with pytest.raises(RequestError) as refused:
            parse({"prompt": "x", "logprobs": logprobs})
        assert refused.value.param == "logprobs"
        assert refused.value.reason == f"Requested sample logprobs of {wanted}, which is greater than max allowed: 20"
    wide = CompletionLimits(vocab_size=50, max_logprobs=-1)
    assert parse({"prompt": "x", "logprobs": -1}, wide).sampling.num_logprobs == -1


def test_echo_takes_max_tokens_zero_and_asks_for_the_prompts_log_probabilities():
    request = parse({"prompt": "x", "echo": True, "max_tokens": 0, "logprobs": 2})
    assert request.max_tokens == 0 and request.sampling.max_new_tokens == 1  # one generated, not shown (vLLM)
    assert (request.sampling.echo, request.sampling.prompt_logprobs) == (True, 2)
    assert parse({"prompt": "x", "echo": True}).sampling.prompt_logprobs is None  # the prompt's text only


def test_n_above_one_is_refused_for_greedy_sampling_as_vllm_refuses_it():
    with pytest.raises(RequestError) as refused:
        parse({"prompt": "x", "n": 2, "temperature": 0})
    assert refused.value.param == "n" and "greedy" in refused.value.reason
    assert parse({"prompt": "x", "n": 3, "temperature": 0.5}).sampling.n == 3


def test_max_tokens_is_bounded_by_the_context_not_a_fixed_cap():
    assert parse({"prompt": "x", "max_tokens": 64}).max_tokens == 64
    assert parse({"prompt": "x", "max_tokens": 5000}, CompletionLimits()).max_tokens == 5000  # context unknown yet
    with pytest.raises(RequestError) as caught:
        parse({"prompt": "x", "max_tokens": 65})
    assert caught.value.param == "max_tokens"
    assert "max_tokens=65 cannot be greater than max_model_len=64" in caught.value.reason


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
    ("payload", "param", "words"),
    [
        ({}, "prompt", "'prompt' is required"),
        ({"prompt": None}, "prompt", "'prompt' is required"),
        ({"prompt": 5}, "prompt", "must be a string, a list of strings"),
        ({"prompt": ""}, "prompt", "must not be empty"),
        ({"prompt": [""]}, "prompt[0]", "must not be empty"),
        ({"prompt": []}, "prompt", "not empty"),
        ({"prompt": ["a", 1]}, "prompt", "not a mixture"),
        ({"prompt": [[1], []]}, "prompt[1]", "must not be empty"),
        ({"prompt": [[1], [1.5]]}, "prompt[1]", "token ids (integers)"),
        ({"prompt": [1, True]}, "prompt", "not a mixture"),
        ({"prompt": [3, 50]}, "prompt", "Token id 50 in 'prompt' is out of vocabulary"),
        ({"prompt": [[-1]]}, "prompt[0]", "Token id -1"),
        ({"prompt": "x" * 101}, "prompt", "101 characters"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", "out of range"),
        ({"prompt": "x", "max_tokens": 2.5}, "max_tokens", "must be an integer"),
        ({"prompt": "x", "max_tokens": True}, "max_tokens", "must be an integer"),
        ({"prompt": "x", "temperature": -0.1}, "temperature", "out of range"),
        ({"prompt": "x", "temperature": 2.5}, "temperature", "out of range"),
        ({"prompt": "x", "temperature": "hot"}, "temperature", "must be a number"),
        ({"prompt": "x", "temperature": 10**400}, "temperature", "too large"),
        ({"prompt": "x", "logit_bias": {"1": 10**400}}, "logit_bias", "too large"),
        ({"prompt": "x", "top_p": 0}, "top_p", "(0, 1]"),
        ({"prompt": "x", "top_p": 1.5}, "top_p", "(0, 1]"),
        ({"prompt": "x", "top_k": -2}, "top_k", "at least 1"),
        ({"prompt": "x", "top_k": 1.5}, "top_k", "must be an integer"),
        ({"prompt": "x", "min_p": 1.5}, "min_p", "[0, 1]"),
        ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
        ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty", "[-2, 2]"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "> 0"),
        ({"prompt": "x", "logit_bias": {"x": 1}}, "logit_bias", "keys must be token ids"),
        ({"prompt": "x", "logit_bias": {"99": 1}}, "logit_bias", "out of vocabulary"),
        ({"prompt": "x", "logit_bias": [1]}, "logit_bias", "must map token ids"),
        ({"prompt": "x", "min_tokens": -1}, "min_tokens", ">= 0"),
        ({"prompt": "x", "min_tokens": 17}, "min_tokens", "at most max_new_tokens=16"),
        ({"prompt": "x", "ignore_eos": 1}, "ignore_eos", "true or false"),
        ({"prompt": "x", "stop_token_ids": [60]}, "stop_token_ids", "out of vocabulary"),
        ({"prompt": "x", "stop_token_ids": 3}, "stop_token_ids", "list of token ids"),
        ({"prompt": "x", "n": 0}, "n", ">= 1"),
        ({"prompt": "x", "logprobs": -2}, "logprobs", "-1"),
        ({"prompt": "x", "logprobs": "3"}, "logprobs", "must be an integer"),
        ({"prompt": "x", "echo": "yes"}, "echo", "true or false"),
        ({"prompt": "x", "stream": 1}, "stream", "true or false"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "only be defined when"),
        ({"prompt": "x", "stream": True, "stream_options": [1]}, "stream_options", "must be an object"),
        ({"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}}, "stream_options", "true or false"),
        ({"prompt": "x", "seed": -1}, "seed", "'seed'"),
        ({"prompt": "x", "seed": 2**63}, "seed", "'seed'"),
        ({"prompt": "x", "seed": "7"}, "seed", "'seed'"),
        ({"prompt": "x", "stop": 3}, "stop", "'stop' must be"),
        ({"prompt": "x", "stop": ["a", 3]}, "stop", "'stop' must be"),
        ({"prompt": "x", "stop": ""}, "stop", "must not be empty"),
        ({"prompt": "x", "user": 7}, "user", "'user' must be a string"),
        ({"prompt": "x", "suffix": "end"}, "suffix", "not yet implemented"),
        ({"prompt": "x", "use_beam_search": True}, "use_beam_search", "not yet implemented"),
        ({"prompt": "x", "response_format": {"type": "xml"}}, "response_format", "'type' is 'text'"),
        ({"prompt": "x", "response_format": {"type": "json_schema"}}, "response_format", "needs 'json_schema'"),
        ({"prompt": "x", "structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"prompt": "x", "structured_outputs": {"choice": "a"}}, "structured_outputs", "wrong type"),
        ({"prompt": "x", "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
         "structured_outputs", "both set"),
    ],
)
def test_invalid_fields_are_a_400_naming_the_field(payload, param, words):
    with pytest.raises(RequestError) as caught:
        parse(payload)
    assert (caught.value.status, caught.value.param) == (400, param)
    assert words in caught.value.reason


def test_another_model_is_a_404():
    with pytest.raises(RequestError) as caught:
        parse({"prompt": "x", "model": "gpt-4"})
    assert (caught.value.status, caught.value.param) == (404, "model")
    assert caught.value.reason == "The model `gpt-4` does not exist."


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "repetition_penalty"])
def test_non_finite_numbers_are_refused(field, value):
    with pytest.raises(RequestError) as caught:
        parse(b'{"prompt": "x", "' + field.encode() + b'": ' + value.encode() + b"}")
    assert (caught.value.status, caught.value.param) == (400, field)


def test_a_text_response_format_is_the_default():
    assert parse({"prompt": "x", "response_format": {"type": "text"}}) == parse({"prompt": "x"})


def test_structured_output_is_parsed_into_vllms_arguments():
    schema = {"type": "string", "enum": ["yes", "no"]}
    asked = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    assert json.loads(parse({"prompt": "x", "response_format": asked}).sampling.structured_outputs) == {"json": schema}
    assert parse({"prompt": "x", "response_format": {"type": "json_object"}}).sampling.structured_outputs == \
        '{"json_object":true}'
    assert parse({"prompt": "x", "structured_outputs": {"choice": ["a", "b"]}}).sampling.structured_outputs == \
        '{"choice":["a","b"]}'


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_body_bytes", 0),
        ("max_prompt_chars", 1.5),
        ("max_temperature", -1.0),
        ("max_temperature", float("inf")),
        ("max_temperature", "2"),
        ("max_context", 0),
        ("vocab_size", True),
    ],
)
def test_invalid_limits_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"CompletionLimits.{field}"):
        CompletionLimits(**{field: value})


def test_default_limits_know_no_model_until_a_replica_fills_them_in():
    limits = CompletionLimits()
    assert (limits.max_body_bytes, limits.max_prompt_chars, limits.max_temperature) == (65536, 16384, 10.0)
    assert (limits.max_context, limits.vocab_size) == (None, None)


@pytest.mark.parametrize(
    ("text", "stop", "include", "expected"),
    [
        ("hello\nworld", ("\n",), False, ("hello", True)),
        ("hello\nworld", ("\n",), True, ("hello\n", True)),
        ("a#b\nc", ("\n", "#"), False, ("a", True)),
        ("abc", ("x",), False, ("abc", False)),
        ("abc", (), True, ("abc", False)),
        ("stop", ("stop",), False, ("", True)),
        ("xxENDyyEND", ("END",), True, ("xxEND", True)),
    ],
)
def test_apply_stop_cuts_at_the_earliest_stop(text, stop, include, expected):
    assert apply_stop(text, stop, include=include) == expected


def test_completion_response_has_one_choice_per_prompt_with_its_index():
    body = completion_response(request_id="cmpl-1", model_name=MODEL, created=1700000000,
                               choices=[completion_choice(0, " world", "length"), completion_choice(1, "!", "stop")],
                               prompt_tokens=5, completion_tokens=3)
    assert body == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1700000000,
        "model": MODEL,
        "choices": [{"index": 0, "text": " world", "finish_reason": "length", "logprobs": None},
                    {"index": 1, "text": "!", "finish_reason": "stop", "logprobs": None}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
    }
    assert json.loads(json.dumps(body)) == body
    chunk = completion_chunk(request_id="c", model_name=MODEL, created=0, text="a", finish_reason=None, index=1)
    assert chunk["choices"] == [{"index": 1, "text": "a", "finish_reason": None, "logprobs": None}]


def test_completion_response_refuses_unknown_finish_reasons():
    with pytest.raises(ValueError, match="finish_reason"):
        completion_choice(0, "", "eos")


def test_error_body_has_vllms_shape():
    assert error_body(400, "top_p is out of range", "top_p") == {
        "error": {"message": "top_p is out of range", "type": "BadRequestError", "param": "top_p", "code": 400}
    }
    assert error_body(400, "bad")["error"]["param"] is None
    assert error_body(404, "no model")["error"]["type"] == "NotFoundError"
    assert error_body(500, "boom")["error"]["type"] == "InternalServerError"
    assert error_body(503, "busy")["error"]["type"] == "ServiceUnavailableError"
    assert error_body(413, "big")["error"]["type"] == "Request Entity Too Large"
