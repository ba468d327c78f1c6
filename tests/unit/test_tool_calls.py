"""Tool calls read from chat answers through vLLM's own parser (serving/tool_calls.py), shaped as vLLM's chat
serving layer shapes them (the shapes `vllm serve --enable-auto-tool-choice --tool-call-parser hermes` gave on
2026-12-07: a named or "required" choice constrained by the parser's structural tag, the call's name streamed
as soon as it is read, finish "tool_calls" for "auto" with calls). Tool call ids are random, as vLLM's."""

from __future__ import annotations

import json

import pytest

from baige_ray.serving.openai_api import CompletionLimits
from baige_ray.serving.openai_chat import parse_chat_request
from baige_ray.serving.requests import RequestError
from baige_ray.serving.sampling_params import SamplingParams

pytest.importorskip("vllm")

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
SECOND_CALL = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
LIMITS = CompletionLimits(max_context=256, vocab_size=512)


@pytest.fixture(scope="module")
def parsing(tmp_path_factory):
    from baige_ray.models.tokenizer import load_tokenizer, train_bpe_tokenizer
    from baige_ray.serving.tool_calls import ToolCallParsing
    from tests.hf_helpers import text_files

    root = tmp_path_factory.mktemp("tool-calls")
    tokenizer = load_tokenizer(train_bpe_tokenizer(text_files(root / "text"), root / "tokenizer", vocab_size=512))
    return ToolCallParsing("hermes", tokenizer, "llama")


def chat(parsing, tool_choice=None, *, tools=(WEATHER, TIME), **fields):
    body = {"model": "llama", "messages": [{"role": "user", "content": "weather in Paris?"}], "tools": list(tools),
            **fields}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    parsed = parse_chat_request(json.dumps(body).encode(), LIMITS, model_name="llama", parses_tool_calls=True)
    return parsing.request(parsed.tool_fields, "llama"), parsed


def without_ids(message: dict) -> dict:
    calls = [{**call, "id": call["id"].startswith("chatcmpl-tool-")} for call in message.get("tool_calls", [])]
    return {**message, **({"tool_calls": calls} if "tool_calls" in message else {})}


def test_every_tool_choice_is_taken_where_the_app_parses_tool_calls_and_only_none_where_it_does_not():
    body = {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
    for choice in ("none", "auto", "required", NAMED, None):
        sent = json.dumps({**body, **({"tool_choice": choice} if choice else {})}).encode()
        assert parse_chat_request(sent, LIMITS, model_name="llama", parses_tool_calls=True).tool_fields["tools"]
        if choice == "none":
            assert parse_chat_request(sent, LIMITS, model_name="llama").tool_fields is None
        else:
            with pytest.raises(RequestError, match="tool_call_parser") as refused:
                parse_chat_request(sent, LIMITS, model_name="llama")
            assert refused.value.status == 400 and refused.value.param == "tool_choice"
    unknown = json.dumps({**body, "tool_choice": {"type": "function", "function": {"name": "nope"}}}).encode()
    with pytest.raises(RequestError, match="'nope', which 'tools' does not hold"):
        parse_chat_request(unknown, LIMITS, model_name="llama", parses_tool_calls=True)


def test_a_choice_that_may_call_a_tool_samples_under_the_parsers_grammar_and_keeps_special_tokens(parsing):
    plain = SamplingParams(max_new_tokens=8)
    for choice in (NAMED, "required"):
        calls, _ = chat(parsing, choice)
        sampling = calls.sampling(plain)
        assert "structural_tag" in json.loads(sampling.structured_outputs), choice
        assert sampling.skip_special_tokens is False
    auto, _ = chat(parsing, "auto")
    assert auto.sampling(plain).structured_outputs is None and auto.sampling(plain).skip_special_tokens is False
    none, _ = chat(parsing, "none")
    assert none.sampling(plain) == plain


@pytest.mark.parametrize("choice, text, finish, expected", [
    ("auto", "Sure " + CALL, "stop", ({"role": "assistant", "content": "Sure ", "tool_calls": [
        {"id": True, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        "tool_calls")),
    ("auto", "It is sunny.", "stop", ({"role": "assistant", "content": "It is sunny."}, "stop")),
    (NAMED, CALL, "stop", ({"role": "assistant", "content": "", "tool_calls": [
        {"id": True, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        "stop")),
    ("required", CALL + SECOND_CALL, "stop", ({"role": "assistant", "content": "", "tool_calls": [
        {"id": True, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": True, "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}, "tool_calls")),
    ("required", '<tool_call>{"name": "get_weather", "arguments": ', "length",  # vllm serve's answer, cut short
     ({"role": "assistant", "content": '<tool_call>{"name": "get_weather", "arguments": '}, "length")),
    ("none", "Sure " + CALL, "stop", ({"role": "assistant", "content": "Sure " + CALL}, "stop")),
])
def test_a_whole_answer_is_read_as_vllms_chat_serving_reads_it(parsing, choice, text, finish, expected):
    calls, _ = chat(parsing, choice)
    message, finish_reason = calls.whole(text, (), finish)
    assert (without_ids(message), finish_reason) == expected


def test_parallel_tool_calls_false_keeps_the_first_call(parsing):
    calls, _ = chat(parsing, "auto", parallel_tool_calls=False)
    message, finish_reason = calls.whole(CALL + SECOND_CALL, (), "stop")
    assert [call["function"]["name"] for call in message["tool_calls"]] == ["get_weather"]
    assert finish_reason == "tool_calls"


def test_a_streamed_answer_sends_the_calls_name_once_read_then_its_arguments_as_they_come(parsing):
    calls, _ = chat(parsing, "auto")
    stream = calls.stream()
    pieces = ["Sure ", "<tool_", 'call>{"name": "get_', 'weather", "arguments": {"city"', ': "Paris"}}', "</tool_call>"]
    deltas = [stream.delta(piece, (), finished=False) for piece in pieces] + [stream.delta("", (), finished=True)]
    assert deltas[0] == {"content": "Sure "} and deltas[1] is None and deltas[2] is None
    opening = deltas[3]["tool_calls"]
    assert opening[0]["function"] == {"name": "get_weather"} and opening[0]["id"].startswith("chatcmpl-tool-")
    arguments = "".join(call["function"].get("arguments", "") for delta in deltas[3:] if delta
                        for call in delta.get("tool_calls", []))
    assert json.loads(arguments) == {"city": "Paris"}
    assert stream.finish_reason("stop") == "tool_calls" and stream.finish_reason("length") == "length"
    named = chat(parsing, NAMED)[0].stream()
    for piece in pieces:
        named.delta(piece, (), finished=False)
    assert named.finish_reason("stop") == "stop"  # OpenAI's and vLLM's: a named call ends with "stop"


def test_the_answer_shaper_puts_the_calls_in_the_chat_choice(parsing):
    from baige_ray.models.generation import TokenizerCodec
    from baige_ray.serving.generators import TextOutput
    from baige_ray.serving.openai_choices import AnswerShaper, Choice

    calls, parsed = chat(parsing, "auto")
    shaper = AnswerShaper([Choice(prompt_index=0, prompt=[1, 2], params=parsed.sampling)], chat=True,
                          codec=TokenizerCodec(parsing.tokenizer), tool_calls=calls)
    choice = shaper.whole(0, TextOutput("Sure " + CALL, 2, 20, "stop"))
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Sure "
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    streamed = AnswerShaper([Choice(prompt_index=0, prompt=[1, 2], params=parsed.sampling)], chat=True,
                            codec=TokenizerCodec(parsing.tokenizer), tool_calls=chat(parsing, "auto")[0])
    from baige_ray.serving.generators import TextDelta

    chunks = [streamed.chunk(0, TextDelta(piece)) for piece in ("Sure ", CALL)]
    last = streamed.chunk(0, TextOutput("Sure " + CALL, 2, 20, "stop"))
    assert chunks[0]["delta"] == {"content": "Sure "} and chunks[1]["delta"]["tool_calls"][0]["function"]["name"] == \
        "get_weather"
    assert last["finish_reason"] == "tool_calls"


def test_serve_takes_a_tool_call_parser_only_with_the_vllm_engine_and_by_a_name_vllm_knows():
    from baige_ray.serving.app import ServeOptions

    with pytest.raises(ValueError, match=r"ServeOptions.tool_call_parser='hermes' is set with engine='builtin'"):
        ServeOptions(tool_call_parser="hermes")
    with pytest.raises(ValueError, match=r"ServeOptions.tool_call_parser='hermez' is invalid: expected one of .*hermes"):
        ServeOptions(engine="vllm", tool_call_parser="hermez")
    assert ServeOptions(engine="vllm", tool_call_parser="hermes").tool_call_parser == "hermes"
