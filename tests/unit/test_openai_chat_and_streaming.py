"""Chat request parsing, the stop-string scanner of streamed text, and incremental detokenization."""

from __future__ import annotations

import json

import pytest

from baige_ray.models.generation import plain_chat_prompt
from baige_ray.models.gpt_decoding import ByteCodec
from baige_ray.serving.openai_api import CompletionLimits, StopScanner
from baige_ray.serving.openai_chat import ChatRequest, parse_chat_request
from baige_ray.serving.openai_responses import server_sent_event
from baige_ray.serving.requests import RequestError

LIMITS = CompletionLimits(max_prompt_chars=100, max_context=64, vocab_size=50)
USER = {"role": "user", "content": "x"}


def parse(payload) -> ChatRequest:
    return parse_chat_request(json.dumps(payload).encode(), LIMITS, model_name="m")


def test_a_chat_request_with_text_parts_and_streaming():
    request = parse({"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": [{"type": "text", "text": "hi"},
                                                                             {"type": "text", "text": "there"}]}],
                     "max_completion_tokens": 5, "temperature": 0, "stream": True,
                     "stream_options": {"include_usage": True}})
    assert request.messages == (("system", "Be brief."), ("user", "hi\nthere"))  # parts joined as vLLM joins them
    assert (request.max_tokens, request.stream, request.usage.at_end) == (5, True, True)
    assert request.sampling.max_new_tokens == 5 and request.sampling.temperature == 0.0
    assert plain_chat_prompt(request.messages) == "system: Be brief.\nuser: hi\nthere\nassistant:"


def test_extra_message_fields_and_unknown_request_fields_are_ignored():
    request = parse({"messages": [{"role": "user", "content": "x", "name": "ann", "tool_calls": None},
                                  {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}],
                     "tools": [], "parallel_tool_calls": True, "reasoning_effort": None, "frequency_penalty": None})
    assert request.messages == (("user", "x"), ("assistant", ""))


def test_without_max_tokens_a_chat_may_use_the_rest_of_the_context():
    request = parse({"messages": [USER]})
    assert (request.max_tokens, request.max_tokens_field) == (None, "max_tokens")
    assert request.sampling.max_new_tokens == 1  # provisional: the replica sets the rest of the context


@pytest.mark.parametrize(("fields", "expected"), [
    ({"max_tokens": 7}, (7, "max_tokens")),
    ({"max_completion_tokens": 9}, (9, "max_completion_tokens")),
    ({"max_tokens": 7, "max_completion_tokens": 9}, (9, "max_completion_tokens")),  # vLLM: the newer field wins
    ({"max_tokens": 7, "max_completion_tokens": None}, (7, "max_tokens")),
])
def test_max_completion_tokens_is_an_alias_that_wins(fields, expected):
    request = parse({"messages": [USER], **fields})
    assert (request.max_tokens, request.max_tokens_field) == expected
    assert request.sampling.max_new_tokens == expected[0]


def test_chat_logprobs_and_top_logprobs():
    assert parse({"messages": [USER]}).sampling.num_logprobs is None
    assert parse({"messages": [USER], "logprobs": False, "top_logprobs": 0}).sampling.num_logprobs is None
    assert parse({"messages": [USER], "logprobs": True}).sampling.num_logprobs == 0
    assert parse({"messages": [USER], "logprobs": True, "top_logprobs": 4}).sampling.num_logprobs == 4


@pytest.mark.parametrize(("payload", "status", "words"), [
    ({}, 400, "'messages' is required"),
    ({"messages": []}, 400, "'messages' is required"),
    ({"messages": ["hi"]}, 400, "messages[0] must be an object"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "role='robot'"),
    ({"messages": [{"role": "user", "content": 3}]}, 400, "string or a list of text parts"),
    ({"messages": [{"role": "user", "content": None}]}, 400, "string or a list of text parts"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "has type 'image_url'"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, 400, "content[0].text"),
    ({"messages": [{"role": "user", "content": ["x"]}]}, 400, "content[0] must be an object"),
    ({"messages": [{"role": "user", "content": "x" * 101}]}, 400, "more than 100"),
    ({"messages": [USER], "max_completion_tokens": 65}, 400, "max_completion_tokens=65 cannot be greater"),
    ({"messages": [USER], "max_tokens": 0}, 400, "'max_tokens'=0 is out of range"),
    ({"messages": [USER], "top_logprobs": 2}, 400, "'logprobs' must be set to true"),
    ({"messages": [USER], "logprobs": 1}, 400, "'logprobs' must be true or false"),
    ({"messages": [USER], "tools": [{"type": "function"}], "tool_choice": "auto"}, 400, "tools[0].function"),
    ({"messages": [USER], "max_tokens": 4, "min_tokens": 5}, 400, "'min_tokens'"),
    ({"messages": [USER], "model": "other"}, 404, "does not exist"),
])
def test_invalid_chat_requests_name_the_problem(payload, status, words):
    with pytest.raises(RequestError) as raised:
        parse(payload)
    assert raised.value.status == status and words in raised.value.reason


def test_a_min_tokens_beyond_the_budget_of_a_chat_without_max_tokens_is_checked_when_the_budget_is_known():
    from baige_ray.serving.openai_sampling import with_budget

    request = parse({"messages": [USER], "min_tokens": 5})
    assert request.sampling.max_new_tokens == 5
    assert with_budget(request.sampling, 30).max_new_tokens == 30
    with pytest.raises(RequestError) as raised:
        with_budget(request.sampling, 4)
    assert (raised.value.status, raised.value.param) == (400, "min_tokens")


def test_the_stop_scanner_never_sends_a_stop_string_even_split_across_pieces():
    scanner = StopScanner(("END",))
    sent = "".join(scanner.push(piece) for piece in ["abc E", "N", "D more"])
    assert sent == "abc " and scanner.stopped and scanner.flush() == ""
    plain = StopScanner(("END",))
    assert "".join(plain.push(piece) for piece in ["abc E", "N"]) + plain.flush() == "abc EN"
    assert not plain.stopped and StopScanner(()).push("xyz") == "xyz"


def test_the_stop_scanner_keeps_the_stop_string_when_asked():
    scanner = StopScanner(("END", "\n"), include=True)
    sent = "".join(scanner.push(piece) for piece in ["abc E", "N", "D more\n"])
    assert sent == "abc END" and scanner.stopped and scanner.flush() == ""


def test_bytes_decode_incrementally_without_splitting_characters():
    decoder = ByteCodec().decoder()
    pieces = [decoder.push(byte) for byte in "añ€".encode()]
    assert pieces == ["a", "", "ñ", "", "", "€"] and decoder.flush() == ""
    broken = ByteCodec().decoder()
    assert broken.push(0xE2) == "" and broken.flush() == ""  # never finished: dropped, as vLLM drops it
    invalid = ByteCodec().decoder()
    assert invalid.push(0xFF) == "\ufffd" and invalid.push(0x41) == "A" and invalid.flush() == ""


def test_tokenizer_text_is_streamed_as_it_becomes_whole(tmp_path):
    from baige_ray.models.generation import TokenizerCodec
    from baige_ray.models.tokenizer import load_tokenizer, train_bpe_tokenizer

    text = tmp_path / "text.txt"
    text.write_text("def parse(text):\n    return text.split()  # naïve €\n" * 20)
    codec = TokenizerCodec(load_tokenizer(train_bpe_tokenizer([text], tmp_path / "tok", vocab_size=300)))
    ids = codec.encode("return naïve € text")
    decoder = codec.decoder()
    streamed = "".join(decoder.push(token) for token in ids) + decoder.flush()
    assert streamed == codec.tokenizer.decode(ids, skip_special_tokens=True)
    assert codec.chat_tokens((("user", "hi"),)) == codec.encode("user: hi\nassistant:")
    cut = codec.encode("text 漢")[:-1]  # ends inside the three bytes of a character the tokenizer never saw
    assert codec.tokenizer.decode(cut).endswith("\ufffd")
    decoder = codec.decoder()
    assert "".join(decoder.push(token) for token in cut) + decoder.flush() == "text "  # as vLLM: dropped


def test_server_sent_events_are_data_lines():
    assert server_sent_event({"a": 1}) == b'data: {"a":1}\n\n' and server_sent_event("[DONE]") == b"data: [DONE]\n\n"


def test_a_chat_template_that_cannot_render_the_messages_is_a_400_not_a_500():
    from baige_ray.serving.openai_tokenize import chat_prompt_tokens

    class TemplateError(Exception):  # jinja2's is matched by name, as vLLM matches it
        pass

    class Codec:
        def __init__(self, error: Exception):
            self.error = error

        def chat_tokens(self, messages, tools=None):
            raise self.error

    with pytest.raises(RequestError) as raised:
        chat_prompt_tokens(Codec(TemplateError("Conversation roles must alternate")), (("user", "x"),))
    assert (raised.value.status, raised.value.param) == (400, "messages")
    assert "roles must alternate" in raised.value.reason
    with pytest.raises(KeyError):  # anything else is the server's own fault
        chat_prompt_tokens(Codec(KeyError("x")), (("user", "x"),))
