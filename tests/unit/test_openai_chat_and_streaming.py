"""Chat request parsing, the stop-string scanner of streamed text, and incremental detokenization."""

from __future__ import annotations

import json

import pytest

from baige_ray.models.generation import plain_chat_prompt
from baige_ray.models.gpt_decoding import ByteCodec
from baige_ray.serving.openai_api import CompletionLimits, StopScanner, server_sent_event
from baige_ray.serving.openai_chat import parse_chat_request
from baige_ray.serving.requests import RequestError

LIMITS = CompletionLimits(max_tokens=64, max_prompt_chars=100)


def parse(payload) -> object:
    return parse_chat_request(json.dumps(payload).encode(), LIMITS, model_name="m")


def test_a_chat_request_with_text_parts_and_streaming():
    request = parse({"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                     "max_completion_tokens": 5, "temperature": 0, "stream": True,
                     "stream_options": {"include_usage": True}})
    assert request.messages == (("system", "Be brief."), ("user", "hi"))
    assert (request.max_tokens, request.stream, request.include_usage) == (5, True, True)
    assert plain_chat_prompt(request.messages) == "system: Be brief.\nuser: hi\nassistant:"


@pytest.mark.parametrize(("payload", "status", "words"), [
    ({}, 422, "'messages' is required"),
    ({"messages": []}, 422, "'messages' is required"),
    ({"messages": ["hi"]}, 422, "messages[0] must be an object"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 422, "role='robot'"),
    ({"messages": [{"role": "user", "content": 3}]}, 422, "string or a list of text parts"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 422, "list of text parts"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, 422, "unsupported fields"),
    ({"messages": [{"role": "user", "content": ""}]}, 422, "every message is empty"),
    ({"messages": [{"role": "user", "content": "x" * 101}]}, 422, "more than 100"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "max_completion_tokens": 1}, 422, "not both"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 65}, 422, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": []}, 422, "unknown fields"),
    ({"messages": [{"role": "user", "content": "x"}], "model": "other"}, 404, "does not exist"),
])
def test_invalid_chat_requests_name_the_problem(payload, status, words):
    with pytest.raises(RequestError) as raised:
        parse(payload)
    assert raised.value.status == status and words in raised.value.reason


def test_the_stop_scanner_never_sends_a_stop_string_even_split_across_pieces():
    scanner = StopScanner(("END",))
    sent = "".join(scanner.push(piece) for piece in ["abc E", "N", "D more"])
    assert sent == "abc " and scanner.stopped and scanner.flush() == ""
    plain = StopScanner(("END",))
    assert "".join(plain.push(piece) for piece in ["abc E", "N"]) + plain.flush() == "abc EN"
    assert not plain.stopped and StopScanner(()).push("xyz") == "xyz"


def test_bytes_decode_incrementally_without_splitting_characters():
    decoder = ByteCodec().decoder()
    pieces = [decoder.push(byte) for byte in "añ€".encode()]
    assert pieces == ["a", "", "ñ", "", "", "€"] and decoder.flush() == ""
    broken = ByteCodec().decoder()
    assert broken.push(0xE2) == "" and broken.flush() == "\ufffd"


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


def test_server_sent_events_are_data_lines():
    assert server_sent_event({"a": 1}) == b'data: {"a":1}\n\n' and server_sent_event("[DONE]") == b"data: [DONE]\n\n"
