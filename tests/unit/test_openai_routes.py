"""The OpenAI routes end to end without Ray: a `ModelServer` built around a real engine runner (the
built-in engine on a tiny reference GPT, byte tokens) answers Starlette requests as Serve would hand
them. Several prompts, token-id prompts, streams, chat budgets, tokenize, the model list and the
error bodies, as vLLM's server answers them. (n, echo and log-probabilities: test_openai_choices.py.)"""

from __future__ import annotations

import pytest

from baige_ray.models.gpt_decoding import ByteCodec
from baige_ray.serving.openai_routes import served_root
from tests.unit.fixtures.openai_server import CONFIG, call, make_server, stop_server


@pytest.fixture(scope="module")
def server():
    made = make_server()
    yield made
    stop_server(made)


def complete(server, prompt, **fields) -> dict:
    status, body = call(server, "v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0, **fields})
    assert status == 200, body
    return body


def test_several_prompts_get_one_choice_each_with_its_index(server):
    alone = [complete(server, text)["choices"][0]["text"] for text in ("def ", "import", "x = ")]
    together = complete(server, ["def ", "import", "x = "])
    assert [choice["index"] for choice in together["choices"]] == [0, 1, 2]
    assert [choice["text"] for choice in together["choices"]] == alone
    assert together["usage"] == {"prompt_tokens": 4 + 6 + 4, "completion_tokens": 18, "total_tokens": 32}


def test_token_id_prompts_are_submitted_as_they_are(server):
    text = complete(server, "def ")["choices"][0]["text"]
    assert complete(server, list(b"def "))["choices"][0]["text"] == text
    both = complete(server, [list(b"def "), list(b"import")])
    assert [choice["text"] for choice in both["choices"]] == [text, complete(server, "import")["choices"][0]["text"]]


def test_a_streamed_multi_prompt_completion_sends_each_choice_its_text(server):
    whole = complete(server, ["def ", "import"])
    status, events = call(server, "v1/completions", {"prompt": ["def ", "import"], "max_tokens": 6, "temperature": 0,
                                                     "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and events[-1] == "[DONE]" and events[-2]["usage"] == whole["usage"]
    for index, choice in enumerate(whole["choices"]):
        mine = [event["choices"][0] for event in events[:-2] if event["choices"][0]["index"] == index]
        assert "".join(piece["text"] for piece in mine) == choice["text"]
        assert mine[-1]["finish_reason"] == choice["finish_reason"] and mine[-1]["text"] == ""


def test_continuous_usage_stats_put_each_choices_counts_so_far_in_every_chunk(server):
    """stream_options.continuous_usage_stats with include_usage (vLLM needs both): every chunk carries its
    choice's prompt tokens and the tokens generated so far; alone it adds nothing."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    status, events = call(server, "v1/completions", {"prompt": ["def ", "import"], "max_tokens": 6, "temperature": 0,
                                                     "stream": True, "stream_options": options})
    assert status == 200 and events[-2]["usage"]["completion_tokens"] == 12
    for index, prompt_tokens in enumerate((4, 6)):
        counts = [event["usage"] for event in events[:-2] if event["choices"][0]["index"] == index]
        assert {count["prompt_tokens"] for count in counts} == {prompt_tokens}
        completed = [count["completion_tokens"] for count in counts]
        assert completed == sorted(completed) and completed[-1] == 6 and completed[0] >= 1
    status, events = call(server, "v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 3, "stream": True, "stream_options": options})
    assert events[0]["usage"]["completion_tokens"] == 0 and events[-3]["usage"]["completion_tokens"] == 3
    status, events = call(server, "v1/completions", {"prompt": "def ", "max_tokens": 2, "stream": True,
                                                     "stream_options": {"continuous_usage_stats": True}})
    assert status == 200 and not any("usage" in event for event in events[:-1])
    status, body = call(server, "v1/completions", {"prompt": "def ", "stream": True,
                                                   "stream_options": {"continuous_usage_stats": "yes"}})
    assert status == 400 and "continuous_usage_stats' must be true or false" in body["error"]["message"]


def test_each_request_reports_its_tokens_and_their_timing_to_the_metrics(server):
    """Prompt and generated tokens, time to first token and the mean time per token after it (vLLM's
    server metrics), for every choice, streamed or not."""
    records = server._metrics.token_records
    records.clear()
    complete(server, ["def ", "import"])
    call(server, "v1/completions", {"prompt": "x = ", "max_tokens": 1, "stream": True})
    assert [(r["prompt_tokens"], r["generated_tokens"]) for r in records[:2]] in ([(4, 6), (6, 6)], [(6, 6), (4, 6)])
    assert (records[2]["prompt_tokens"], records[2]["generated_tokens"]) == (4, 1)
    assert all(0 < r["time_to_first_token_s"] < 60 and 0 < r["time_per_output_token_s"] < 60 for r in records[:2])
    assert records[2]["time_per_output_token_s"] is None  # one token: no gap to measure


def test_a_sampled_stop_token_counts_among_the_completion_tokens_but_not_in_the_text(server):
    """As in vLLM: the token that ended the request (a stop token id, end of text) is in completion_tokens."""
    text = complete(server, "def ")["choices"][0]["text"]
    stop = text.index(text[2])  # byte tokens: the first position of the third character's token
    body = complete(server, "def ", stop_token_ids=[ord(text[2])])
    assert body["choices"][0]["text"] == text[:stop] and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == stop + 1


def test_a_chat_without_max_tokens_generates_up_to_the_rest_of_the_context(server):
    status, body = call(server, "v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                        "temperature": 0})
    prompt = len(ByteCodec().chat_tokens((("user", "hi"),)))
    assert status == 200 and body["usage"]["prompt_tokens"] == prompt
    assert body["usage"]["completion_tokens"] == CONFIG.seq_len - prompt  # no end of text: the budget is used up
    assert body["choices"][0]["finish_reason"] == "length"


def test_neutral_sampling_fields_are_accepted_and_stop_tokens_honoured(server):
    plain = complete(server, "def ")["choices"][0]["text"]
    neutral = complete(server, "def ", top_p=1, min_p=0, presence_penalty=0, frequency_penalty=0, repetition_penalty=1,
                       n=1, ignore_eos=False, best_of=1, logprobs=None, echo=False)
    assert neutral["choices"][0]["text"] == plain
    stop = complete(server, "def ", stop_token_ids=[ord(plain[2])])
    assert stop["choices"][0] == {"index": 0, "text": plain[:2], "finish_reason": "stop", "logprobs": None}
    kept = complete(server, "def ", stop=[plain[2:4]], include_stop_str_in_output=True)
    assert kept["choices"][0]["text"] == plain[:4]


@pytest.mark.parametrize(("fields", "changed"), [
    ({"logit_bias": {str(ord("Q")): 100}}, True), ({"repetition_penalty": 2.0}, True), ({"top_p": 0.9}, False),
    ({"min_p": 0.5}, False), ({"presence_penalty": -2, "frequency_penalty": 0.5}, True), ({"min_tokens": 3}, False),
])
def test_the_builtin_engine_samples_with_every_field(server, fields, changed):
    plain = complete(server, "def ")["choices"][0]["text"]
    text = complete(server, "def ", **fields)["choices"][0]["text"]
    assert (text != plain) == changed  # top-p, min-p mean nothing greedily; min_tokens nothing without an end
    if "logit_bias" in fields:
        assert text == "Q" * 6


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"suffix": "x"}, "suffix", "not yet implemented"), ({"use_beam_search": True}, "use_beam_search", "not yet"),
    ({"response_format": {"type": "json_object"}}, "response_format", "implemented by serve(engine='vllm')"),
    ({"n": 2, "temperature": 0}, "n", "greedy"), ({"logprobs": 21}, "logprobs", "max allowed: 20"),
])
def test_what_is_still_missing_or_out_of_range_is_a_400_naming_the_field(server, fields, param, message):
    status, body = call(server, "v1/completions", {"prompt": "x", "temperature": 0.5, **fields})
    assert status == 400 and body["error"]["param"] == param and body["error"]["type"] == "BadRequestError"
    assert message in body["error"]["message"]
    status, body = call(server, "v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                        "tools": [{"type": "function"}], "tool_choice": "auto"})
    assert status == 400 and body["error"]["param"] == "tools"


def test_refusals_have_vllms_error_shape(server):
    status, body = call(server, "v1/completions", {"prompt": [3, 999]})
    assert status == 400 and body == {"error": {"message": "Token id 999 in 'prompt' is out of vocabulary (the "
                                                           "vocabulary holds 256 tokens)", "type": "BadRequestError",
                                                "param": "prompt", "code": 400}}
    status, body = call(server, "v1/completions", {"prompt": "x" * 64, "max_tokens": 10})
    assert status == 400 and body["error"]["param"] == "prompt"
    assert body["error"]["message"].startswith("This model's maximum context length is 64 tokens.")
    status, body = call(server, "v1/completions", {"prompt": "x", "max_tokens": 65})
    assert status == 400 and "cannot be greater than max_model_len=64" in body["error"]["message"]
    status, body = call(server, "v1/completions", {"prompt": "x", "model": "other"})
    assert (status, body["error"]["type"], body["error"]["param"]) == (404, "NotFoundError", "model")
    assert call(server, "generate", {"prompt": ""}) == (400, {"error": "'prompt' must not be empty"})


def test_max_tokens_beyond_the_rest_of_the_context_generates_to_its_end_as_vllm_does(server):
    status, body = call(server, "v1/completions", {"prompt": "x" * 60, "max_tokens": 10, "temperature": 0})
    assert status == 200 and body["usage"] == {"prompt_tokens": 60, "completion_tokens": 4, "total_tokens": 64}
    assert body["choices"][0]["finish_reason"] == "length"


def test_tokenize_and_detokenize(server):
    status, body = call(server, "tokenize", {"prompt": "héllo", "add_special_tokens": True})
    assert status == 200 and body == {"count": 6, "max_model_len": 64, "tokens": list("héllo".encode())}
    status, chat = call(server, "tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert chat["tokens"] == ByteCodec().chat_tokens((("user", "hi"),)) and chat["count"] == len(chat["tokens"])
    assert call(server, "detokenize", {"tokens": body["tokens"]}) == (200, {"prompt": "héllo"})
    status, error = call(server, "detokenize", {"tokens": [1, 256]})
    assert status == 400 and error["error"]["param"] == "tokens"
    assert call(server, "tokenize", {"prompt": 3})[0] == 400
    assert call(server, "tokenize", None, method="GET")[0] == 405


def test_the_model_list_and_one_model(server):
    status, body = call(server, "v1/models")
    (card,) = body["data"]
    assert status == 200
    assert (card["id"], card["root"], card["max_model_len"], card["object"]) == ("m", "m", 64, "model")
    assert call(server, "v1/models/m") == (200, card)
    status, missing = call(server, "v1/models/other")
    assert status == 404 and missing["error"]["message"] == "The model `other` does not exist."


def test_the_vllm_engine_is_refused_only_a_temperature_above_its_bound():
    server = make_server("vllm")
    try:
        assert call(server, "v1/completions", {"prompt": "x", "temperature": 2.5})[1]["error"]["param"] == "temperature"
        status, body = call(server, "v1/completions", {"prompt": "x", "n": 2, "logprobs": 2, "echo": True,
                                                       "max_tokens": 2})
        assert status == 200 and len(body["choices"]) == 2
    finally:
        stop_server(server)


def test_the_served_root_is_the_model_directory_when_there_is_one(tmp_path):
    class Directory:
        path = tmp_path

    assert served_root(Directory(), "app") == str(tmp_path) and served_root(CONFIG, "app") == "app"


def test_no_stop_string_ends_within_the_first_min_tokens_tokens_as_in_vllm(server):
    plain = complete(server, "import", max_tokens=12)["choices"][0]["text"]
    assert plain.startswith("\x1a\x1a\x1a^")  # one byte a token: a character a token here
    for min_tokens, expected in ((0, ""), (2, "\x1a\x1a"), (3, plain)):  # no fourth "\x1a" follows
        held = complete(server, "import", max_tokens=12, stop=["\x1a"], min_tokens=min_tokens)["choices"][0]
        assert held["text"] == expected
