"""The OpenAI routes end to end without Ray: a `ModelServer` built around a real engine runner (the
built-in engine on a tiny reference GPT, byte tokens) answers Starlette requests as Serve would hand
them. Several prompts, token-id prompts, streams, chat budgets, tokenize, the model list and the
error bodies, as vLLM's server answers them."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from starlette.requests import Request
from starlette.responses import StreamingResponse

from baige_ray.models.gpt import GPT, GPTConfig
from baige_ray.models.gpt_decoding import ByteCodec, GPTDecoder
from baige_ray.serving.deployment import ModelServer
from baige_ray.serving.engine import ContinuousBatchingEngine, EngineLimits
from baige_ray.serving.engine_runner import EngineRunner
from baige_ray.serving.openai_api import CompletionLimits
from baige_ray.serving.openai_routes import OpenAIRoutes, ReplicaCalls, served_root
from baige_ray.serving.requests import RequestLimits

CONFIG = GPTConfig(seq_len=64, num_layers=1, num_heads=2, hidden=32)


class _NoMetrics:
    def request(self, **_) -> None:
        pass


class _Replica(ModelServer):
    def __del__(self) -> None:  # Serve awaits ModelServer's (a prefix-block hand-over); nothing to hand over here
        pass


def make_server(engine: str = "builtin") -> ModelServer:
    """A replica without Serve: the attributes its constructor would set, a runner on a tiny GPT."""
    torch.manual_seed(0)
    decoder = GPTDecoder(GPT(CONFIG).eval())
    runner = EngineRunner(ContinuousBatchingEngine(decoder, eos_token_id=None,
                                                   limits=EngineLimits(max_batch_size=4, max_waiting=8)), ByteCodec())
    server = object.__new__(_Replica)
    server.__dict__.update(
        _limits=RequestLimits(), _app_name="m", _engine_name=engine, _model_config=CONFIG, _ongoing=0,
        _runner=runner, _pending_latencies=[], _metrics=_NoMetrics(), _step=0, _replica="r", _node="n",
        _ensure_reporter=lambda: None,
    )
    calls = ReplicaCalls(require_runner=server._require_runner, complete=server._complete, text=server._text,
                         account=server._account, account_failure=server._account_failure,
                         count_ongoing=server._count_ongoing)
    server._openai = OpenAIRoutes(calls, app_name="m", engine_name=engine, limits=CompletionLimits())
    server._openai.learn_model(CONFIG, decoder.max_context)
    return server


@pytest.fixture(scope="module")
def server():
    made = make_server()
    yield made
    made._runner.stop()
    made._runner.join()


def call(server: ModelServer, path: str, body: dict | None = None, method: str | None = None) -> tuple[int, object]:
    """(status, JSON body, or the list of server-sent event payloads of a stream)."""
    return asyncio.run(_call(server, path, body, method or ("GET" if body is None else "POST")))


async def _call(server, path, body, method):
    raw = b"" if body is None else json.dumps(body).encode()
    scope = {"type": "http", "method": method, "path": f"/{path}", "root_path": "", "headers": [],
             "query_string": b""}

    async def receive() -> dict:
        return {"type": "http.request", "body": raw, "more_body": False}

    response = await server(Request(scope, receive))
    if not isinstance(response, StreamingResponse):
        return response.status_code, json.loads(response.body)
    chunks = [chunk if isinstance(chunk, bytes) else chunk.encode() async for chunk in response.body_iterator]
    events = [line.removeprefix("data: ") for line in b"".join(chunks).decode().split("\n\n") if line]
    return response.status_code, [event if event == "[DONE]" else json.loads(event) for event in events]


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


@pytest.mark.parametrize(("fields", "param"), [
    ({"top_p": 0.9}, "top_p"), ({"presence_penalty": 0.5}, "presence_penalty"), ({"n": 2}, "n"),
    ({"logprobs": 1}, "logprobs"), ({"echo": True}, "echo"), ({"repetition_penalty": 1.1}, "repetition_penalty"),
])
def test_the_builtin_engine_answers_400_naming_what_it_does_not_implement(server, fields, param):
    status, body = call(server, "v1/completions", {"prompt": "x", "temperature": 0.5, **fields})
    assert status == 400 and body["error"]["param"] == param and body["error"]["type"] == "BadRequestError"
    assert "not yet implemented by the built-in engine" in body["error"]["message"]


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


def test_the_vllm_engine_is_refused_only_what_is_not_wired():
    server = make_server("vllm")
    try:
        status, body = call(server, "v1/completions", {"prompt": "x", "n": 2})
        assert status == 400 and "not yet implemented by the vLLM engine" in body["error"]["message"]
        assert call(server, "v1/completions", {"prompt": "x", "temperature": 2.5})[1]["error"]["param"] == "temperature"
    finally:
        server._runner.stop()
        server._runner.join()


def test_the_served_root_is_the_model_directory_when_there_is_one(tmp_path):
    class Directory:
        path = tmp_path

    assert served_root(Directory(), "app") == str(tmp_path) and served_root(CONFIG, "app") == "app"
