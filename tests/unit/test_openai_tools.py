"""A chat request's `tools` reach the chat template as `vllm serve` hands them over (vLLM's own request
model's dump, compared here), so a template that writes them renders the same prompt; tool choices that
need tool calls parsed are refused as vLLM without a tool parser refuses them."""

import json

import pytest

from baige_ray.serving.openai_tools import parse_tools
from baige_ray.serving.requests import RequestError

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                                      "unknown": 1}},
    {"function": {"name": "now"}},  # type defaults to function, no description or parameters
    {"type": "function", "defer_loading": True, "function": {"name": "lookup", "strict": True}},
]


def test_tools_are_rendered_as_vllms_request_model_dumps_them():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam

    expected = tuple(ChatCompletionToolsParam.model_validate(tool).model_dump() for tool in TOOLS)
    rendered = parse_tools({"tools": TOOLS, "tool_choice": "none"})
    assert rendered == expected
    assert [json.dumps(tool) for tool in rendered] == [json.dumps(tool) for tool in expected]  # key order too
    assert parse_tools({}) is None and parse_tools({"tools": []}) is None


def test_a_template_that_writes_tools_puts_them_in_the_prompt(tmp_path):
    from transformers import AutoTokenizer

    from baige_ray.models.generation import TokenizerCodec
    from tests.hf_helpers import CHAT_TEMPLATES, build_tiny_hf

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_hf(tmp_path).model_dir)
    tokenizer.chat_template = (CHAT_TEMPLATES / "qwen2.5.jinja").read_text()
    codec = TokenizerCodec(tokenizer)
    messages = (("user", "weather in Paris?"),)
    with_tools = tokenizer.decode(codec.chat_tokens(messages, parse_tools({"tools": TOOLS, "tool_choice": "none"})))
    assert '"name": "get_weather"' in with_tools and "get_weather" not in tokenizer.decode(codec.chat_tokens(messages))


@pytest.mark.parametrize("payload, param", [
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS}, "tool_choice"),  # "auto", as OpenAI and vLLM default to when tools are sent
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "now"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools"),
    ({"tools": "get_weather"}, "tools"),
])
def test_what_needs_a_tool_parser_or_is_malformed_is_a_400_naming_the_field(payload, param):
    with pytest.raises(RequestError) as caught:
        parse_tools(payload)
    assert caught.value.status == 400 and caught.value.param == param
