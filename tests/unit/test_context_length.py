"""Context length: a prompt plus max_tokens beyond the model's context is a 400 naming the numbers, never
silently cut; `truncate_prompt_tokens=k` keeps the prompt's last k tokens (-1: as many as fit); a request
without max_tokens (a chat) may generate up to the rest of the context."""

from __future__ import annotations

import json

import pytest

from baige_ray.serving.context_length import fit_context, new_token_budget, openai_budget, require_fit
from baige_ray.serving.openai_api import CompletionLimits, parse_completion_request
from baige_ray.serving.openai_chat import parse_chat_request
from baige_ray.serving.requests import RequestError, RequestLimits, parse_generate_request

PROMPT = list(range(100, 130))  # 30 tokens
CONTEXT = 40


def test_a_prompt_and_max_tokens_beyond_the_context_are_a_400_naming_the_numbers():
    with pytest.raises(RequestError) as raised:
        fit_context(PROMPT, max_tokens=11, max_context=CONTEXT)
    assert (raised.value.status, raised.value.param) == (400, "max_tokens")
    assert raised.value.reason.startswith("This model's maximum context length is 40 tokens. However, you requested "
                                          "41 tokens: 30 in the prompt and max_tokens=11 to generate.")


def test_the_generate_route_names_its_own_field():
    with pytest.raises(RequestError, match="max_new_tokens=11"):
        fit_context(PROMPT, max_tokens=11, max_context=CONTEXT, field="max_new_tokens")


def test_an_exactly_fitting_prompt_is_submitted_whole():
    assert fit_context(PROMPT, max_tokens=10, max_context=CONTEXT) == PROMPT


def test_truncate_prompt_tokens_keeps_the_prompts_tail_which_then_fits():
    assert fit_context(PROMPT, max_tokens=20, max_context=CONTEXT, truncate_prompt_tokens=20) == PROMPT[-20:]
    assert fit_context(PROMPT, max_tokens=5, max_context=CONTEXT, truncate_prompt_tokens=35) == PROMPT  # shorter


def test_a_truncated_prompt_that_still_does_not_fit_is_a_400():
    with pytest.raises(RequestError) as raised:
        fit_context(PROMPT, max_tokens=21, max_context=CONTEXT, truncate_prompt_tokens=20)
    assert raised.value.status == 400 and "20 in the prompt" in raised.value.reason


def test_truncate_prompt_tokens_beyond_the_context_is_refused_naming_the_field():
    with pytest.raises(RequestError) as raised:
        fit_context(PROMPT, max_tokens=1, max_context=CONTEXT, truncate_prompt_tokens=41)
    assert (raised.value.status, raised.value.param) == (400, "truncate_prompt_tokens")
    assert "'truncate_prompt_tokens'=41" in raised.value.reason


def test_truncate_prompt_tokens_minus_one_keeps_as_many_as_fit():
    assert fit_context(PROMPT, max_tokens=15, max_context=CONTEXT, truncate_prompt_tokens=-1) == PROMPT[-25:]
    assert fit_context(PROMPT, max_tokens=5, max_context=CONTEXT, truncate_prompt_tokens=-1) == PROMPT
    long = PROMPT * 2
    assert fit_context(long, max_tokens=None, max_context=CONTEXT, truncate_prompt_tokens=-1) == long[-39:]
    with pytest.raises(RequestError, match="leaves no prompt"):
        fit_context(PROMPT, max_tokens=40, max_context=CONTEXT, truncate_prompt_tokens=-1)


def test_without_max_tokens_the_budget_is_the_rest_of_the_context():
    assert fit_context(PROMPT, max_tokens=None, max_context=CONTEXT) == PROMPT
    assert new_token_budget(len(PROMPT), None, CONTEXT) == 10 and new_token_budget(len(PROMPT), 3, CONTEXT) == 3
    assert fit_context(PROMPT[:39], max_tokens=None, max_context=CONTEXT) == PROMPT[:39]  # one token left
    with pytest.raises(RequestError) as raised:
        fit_context(PROMPT + PROMPT[:10], max_tokens=None, max_context=CONTEXT)
    assert (raised.value.status, raised.value.param) == (400, "prompt")
    assert "your prompt contains 40 input tokens" in raised.value.reason


def test_engines_refuse_what_does_not_fit_with_a_value_error():
    require_fit(30, 10, CONTEXT)
    with pytest.raises(ValueError, match="30 in the prompt and max_new_tokens=11"):
        require_fit(30, 11, CONTEXT)


def parse(route: str, payload: dict):
    body = json.dumps(payload).encode()
    if route == "generate":
        return parse_generate_request(body, RequestLimits())
    if route == "completions":
        return parse_completion_request(body, CompletionLimits(), model_name="m")
    return parse_chat_request(body, CompletionLimits(), model_name="m")


def payload(route: str, **fields) -> dict:
    base = {"messages": [{"role": "user", "content": "hi"}]} if route == "chat" else {"prompt": "hi"}
    return {**base, **fields}


ROUTES = ("generate", "completions", "chat")


@pytest.mark.parametrize("route", ROUTES)
def test_every_route_takes_truncate_prompt_tokens(route):
    assert parse(route, payload(route, truncate_prompt_tokens=5)).truncate_prompt_tokens == 5
    assert parse(route, payload(route)).truncate_prompt_tokens is None
    assert parse(route, payload(route, truncate_prompt_tokens=None)).truncate_prompt_tokens is None


@pytest.mark.parametrize("route", ROUTES)
def test_every_route_takes_truncate_prompt_tokens_minus_one(route):
    assert parse(route, payload(route, truncate_prompt_tokens=-1)).truncate_prompt_tokens == -1


@pytest.mark.parametrize("value", [0, -2, "x", True, 1.5])
@pytest.mark.parametrize("route", ROUTES)
def test_invalid_truncate_prompt_tokens_is_a_400_naming_the_field(route, value):
    with pytest.raises(RequestError) as raised:
        parse(route, payload(route, truncate_prompt_tokens=value))
    assert (raised.value.status, raised.value.param) == (400, "truncate_prompt_tokens")


def test_the_openai_routes_cut_max_tokens_to_the_rest_of_the_context_as_vllm_does():
    assert openai_budget(PROMPT, max_tokens=25, max_context=CONTEXT) == (PROMPT, 10)
    assert openai_budget(PROMPT, max_tokens=3, max_context=CONTEXT) == (PROMPT, 3)
    assert openai_budget(PROMPT, max_tokens=None, max_context=CONTEXT) == (PROMPT, 10)
    assert openai_budget(PROMPT, max_tokens=15, max_context=CONTEXT, truncate_prompt_tokens=-1) == (PROMPT[-25:], 15)
    with pytest.raises(RequestError) as refused:  # no room for one new token
        openai_budget(PROMPT + PROMPT[:10], max_tokens=4, max_context=CONTEXT)
    assert refused.value.status == 400 and refused.value.param == "prompt"
