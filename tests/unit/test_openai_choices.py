"""`n`, `echo` and log-probabilities on the OpenAI routes of the built-in engine, without Ray: choices indexed
as vLLM indexes them and seeded reproducibly, usage, the exact JSON shapes of completions' and chat's
logprobs (checked by hand: importing vLLM's protocol models took 12-25 s here; a one-off run parsed these
bodies with them), streams carrying each token's figures, and the prompt's log-probabilities of an echo
equal to transformers' own forward of a tiny Llama saved with save_pretrained."""

from __future__ import annotations

import pytest
import torch

from baige_ray.serving.engine import ContinuousBatchingEngine, EngineLimits
from baige_ray.serving.engine_runner import EngineRunner
from baige_ray.serving.logprob_token_names import LogprobTokenNames
from tests.unit.fixtures.openai_server import call, make_server, stop_server

COMPLETION_LOGPROBS_KEYS = ["text_offset", "token_logprobs", "tokens", "top_logprobs"]


@pytest.fixture(scope="module")
def server():
    made = make_server()
    yield made
    stop_server(made)


def post(server, path: str, body: dict):
    status, answer = call(server, path, body)
    assert status == 200, answer
    return answer


def completions(server, **fields) -> dict:
    return post(server, "v1/completions", {"max_tokens": 8, "temperature": 1.0, **fields})


def texts(body: dict) -> list[str]:
    return [choice["text"] for choice in body["choices"]]


# -- n ---------------------------------------------------------------------------------------------------------
def test_n_choices_are_indexed_prompt_by_prompt_and_differ_reproducibly_with_a_seed(server):
    body = completions(server, prompt=["def ", "x = "], n=3, seed=7)
    assert [choice["index"] for choice in body["choices"]] == list(range(6))
    assert len(set(texts(body)[:3])) == 3 and len(set(texts(body)[3:])) == 3
    assert texts(completions(server, prompt=["def ", "x = "], n=3, seed=7)) == texts(body)
    # Sample j of a prompt is the request with seed + j: vLLM's derivation of its samples' seeds.
    for index, prompt in enumerate(["def ", "x = "]):
        for sample in range(3):
            alone = completions(server, prompt=prompt, seed=7 + sample)
            assert texts(alone) == [texts(body)[index * 3 + sample]]
    assert body["usage"] == {"prompt_tokens": 8, "completion_tokens": 48, "total_tokens": 56}  # prompts once each
    assert len(set(texts(completions(server, prompt="def ", n=3)))) == 3  # unseeded: still each its own draw


def test_a_chat_with_n_answers_n_choices_and_streams_a_role_for_each(server):
    request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "n": 2, "seed": 3}
    body = post(server, "v1/chat/completions", request)
    assert [choice["index"] for choice in body["choices"]] == [0, 1]
    assert body["choices"][0]["message"] != body["choices"][1]["message"]
    events = post(server, "v1/chat/completions", {**request, "stream": True})
    roles = [event["choices"][0]["index"] for event in events[:-1] if "role" in event["choices"][0]["delta"]]
    assert roles == [0, 1]
    for choice in body["choices"]:
        streamed = "".join(event["choices"][0]["delta"].get("content", "") for event in events[:-1]
                           if event["choices"][0]["index"] == choice["index"])
        assert streamed == choice["message"]["content"]


# -- completions' logprobs and echo ------------------------------------------------------------------------------
def check_completion_logprobs(logprobs: dict, k: int, tokens: int) -> None:
    assert list(logprobs) == COMPLETION_LOGPROBS_KEYS
    assert all(len(logprobs[key]) == tokens for key in COMPLETION_LOGPROBS_KEYS)
    offsets = [sum(len(token) for token in logprobs["tokens"][:i]) for i in range(tokens)]
    assert logprobs["text_offset"] == offsets
    for token, value, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
        if value is None:
            assert top is None
            continue
        assert isinstance(value, float) and -9999.0 <= value <= 0 and 1 <= len(top) <= k + 1
        assert token in top and all(isinstance(v, float) for v in top.values())


def test_completion_logprobs_have_openais_shape_one_entry_per_token(server):
    body = completions(server, prompt=["def ", "x"], logprobs=2, seed=1, n=2)
    for choice in body["choices"]:
        check_completion_logprobs(choice["logprobs"], 2, 8)
        assert "".join(choice["logprobs"]["tokens"]) == choice["text"] or "\ufffd" in choice["text"]
    zero = completions(server, prompt="def ", logprobs=0, seed=1)["choices"][0]["logprobs"]
    assert all(len(top) == 1 for top in zero["top_logprobs"])  # the sampled token's alone


def test_echo_puts_the_prompt_first_and_max_tokens_zero_answers_the_prompt_alone(server):
    answer = completions(server, prompt="def fib", seed=2)["choices"][0]["text"]
    echoed = completions(server, prompt="def fib", seed=2, echo=True)
    assert echoed["choices"][0]["text"] == "def fib" + answer and echoed["choices"][0]["logprobs"] is None
    alone = completions(server, prompt=[list(b"def fib"), list(b"x = 1")], echo=True, max_tokens=0, logprobs=1)
    assert texts(alone) == ["def fib", "x = 1"]
    first = alone["choices"][0]["logprobs"]
    check_completion_logprobs(first, 1, 7)
    assert first["tokens"] == list("def fib") and first["token_logprobs"][0] is None
    assert alone["usage"] == {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14}  # one each, as vLLM
    status, refused = call(server, "v1/completions", {"prompt": "x", "max_tokens": 0})
    assert status == 400 and refused["error"]["param"] == "max_tokens"


def streamed_choices(events: list, index: int) -> list[dict]:
    return [event["choices"][0] for event in events if event != "[DONE]" and event["choices"]
            and event["choices"][0]["index"] == index]


def joined_logprobs(chunks: list[dict]) -> dict:
    return {key: [value for chunk in chunks if chunk["logprobs"] for value in chunk["logprobs"][key]]
            for key in COMPLETION_LOGPROBS_KEYS}


def assert_same_logprobs(got: dict, expected: dict):
    """Tokens and offsets exactly; figures to float32 noise, since a request whose prompt hits the prefix
    cache computes in another batch shape than one that missed it (5e-7 apart in one CI run)."""
    assert {key: got[key] for key in ("tokens", "text_offset")} == \
        {key: expected[key] for key in ("tokens", "text_offset")}
    assert [value is None for value in got["token_logprobs"]] == [value is None for value in expected["token_logprobs"]]
    assert [v for v in got["token_logprobs"] if v is not None] == \
        pytest.approx([v for v in expected["token_logprobs"] if v is not None], abs=1e-5)
    assert len(got["top_logprobs"]) == len(expected["top_logprobs"])
    for top, expected_top in zip(got["top_logprobs"], expected["top_logprobs"]):
        assert (top is None and expected_top is None) or top == pytest.approx(expected_top, abs=1e-5)


def test_a_stream_carries_each_tokens_logprobs_and_echoes_with_each_choices_first_chunk(server):
    request = dict(prompt=["def ", "ab"], echo=True, logprobs=2, n=2, seed=4, max_tokens=6)
    whole = completions(server, **request)
    events = completions(server, **request, stream=True, stream_options={"include_usage": True})
    assert events[-1] == "[DONE]" and events[-2]["usage"] == whole["usage"]
    for choice in whole["choices"]:
        chunks = streamed_choices(events, choice["index"])
        assert chunks[0]["text"].startswith(["def ", "ab"][choice["index"] // 2])
        assert "".join(chunk["text"] for chunk in chunks) == choice["text"]
        assert_same_logprobs(joined_logprobs(chunks), choice["logprobs"])  # offsets go on from chunk to chunk
        assert chunks[-1]["finish_reason"] == choice["finish_reason"]
    (only,) = streamed_choices(completions(server, prompt="ab", echo=True, max_tokens=0, logprobs=1, stream=True), 0)
    assert only["text"] == "ab" and only["finish_reason"] == "length"
    assert only["logprobs"]["tokens"] == ["a", "b"] and only["logprobs"]["token_logprobs"][0] is None


# -- chat's logprobs --------------------------------------------------------------------------------------------
def test_chat_logprobs_have_openais_content_shape_streamed_or_whole(server):
    request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "seed": 5, "logprobs": True,
               "top_logprobs": 2}
    (choice,) = post(server, "v1/chat/completions", request)["choices"]
    content = choice["logprobs"]["content"]
    assert list(choice["logprobs"]) == ["content"] and len(content) == 4
    for entry in content:
        assert list(entry) == ["token", "logprob", "bytes", "top_logprobs"]
        assert entry["bytes"] == list(entry["token"].encode("utf-8")) and len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0] == {key: entry[key] for key in ("token", "logprob", "bytes")}  # sampled first
        assert all(list(top) == ["token", "logprob", "bytes"] for top in entry["top_logprobs"])
    events = post(server, "v1/chat/completions", {**request, "stream": True})
    streamed = [entry for chunk in streamed_choices(events, 0) if chunk["logprobs"]
                for entry in chunk["logprobs"]["content"]]
    assert streamed == content
    plain = post(server, "v1/chat/completions", {**request, "top_logprobs": 0})["choices"][0]["logprobs"]["content"]
    assert [entry["top_logprobs"] for entry in plain] == [[]] * 4


# -- against transformers ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A tiny Llama and its tokenizer saved with save_pretrained, served by the built-in engine with a prefix
    cache, as a replica serves an HF model directory; and transformers' own model loaded from the directory."""
    from transformers import AutoModelForCausalLM

    from baige_ray.models.hf import HFModel
    from baige_ray.models.plugin import plugin_for
    from baige_ray.models.tokenizer import load_tokenizer, train_bpe_tokenizer
    from baige_ray.serving.generators import text_generator
    from baige_ray.serving.kv_blocks import KVCacheConfig, PrefixBlockStore
    from tests.hf_helpers import llama_config

    root = tmp_path_factory.mktemp("llama")
    (root / "text.txt").write_text("def parse(text):\n    return text.split()  # words and spaces\n" * 30)
    tokenizer = load_tokenizer(train_bpe_tokenizer([root / "text.txt"], root / "tok", vocab_size=300))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(llama_config(vocab_size=len(tokenizer)), dtype=torch.float32)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    from safetensors.torch import load_file

    config = HFModel(root / "model")
    generator = text_generator(plugin_for(config), load_file(root / "model" / "model.safetensors"))
    store = PrefixBlockStore(KVCacheConfig(block_tokens=4), torch.device("cpu"), namespace="llama@v1")
    engine = ContinuousBatchingEngine(generator.decoder, eos_token_id=generator.codec.eos_token_id,
                                      limits=EngineLimits(max_batch_size=4), prefixes=store)
    served = make_server(runner=EngineRunner(engine, generator.codec), model_config=config)
    yield served, AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32).eval(), generator.codec
    stop_server(served)


def expected_top(log_probs: torch.Tensor, token: int, k: int, token_text) -> dict:
    ranked = [token] + [t for t in torch.topk(log_probs, k).indices.tolist() if t != token]
    return {token_text(t): float(log_probs[t]) for t in ranked[:k + 1]}


@torch.no_grad()
def test_echoed_prompt_logprobs_equal_transformers_forward_even_with_the_prompt_cached(tiny_llama):
    served, model, codec = tiny_llama
    prompt = "def parse(text):\n    return text.split()"
    ids = codec.encode(prompt)
    post(served, "v1/completions", {"prompt": prompt, "max_tokens": 2})  # its blocks are now in the prefix cache
    assert served._runner.engine.known_prefix_tokens(ids) >= 4
    body = post(served, "v1/completions", {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 3})
    logprobs = body["choices"][0]["logprobs"]
    raw = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    names = LogprobTokenNames(codec)  # a prompt token read after those before it but the first, as vLLM does
    assert body["choices"][0]["text"] == prompt
    assert logprobs["tokens"] == [codec.token_text(ids[0])] + [names.after(ids[1:i])(ids[i]) for i in range(1, len(ids))]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    expected = [float(raw[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert logprobs["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)
    for i in range(1, len(ids)):
        assert logprobs["top_logprobs"][i] == pytest.approx(expected_top(raw[i - 1], ids[i], 3, names.after(ids[1:i])),
                                                             abs=1e-4)


@torch.no_grad()
def test_echoed_and_generated_logprobs_equal_transformers_forward_over_prompt_and_answer(tiny_llama):
    served, model, codec = tiny_llama
    prompt = "return text"
    ids = codec.encode(prompt)
    greedy = model.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0].tolist()
    body = post(served, "v1/completions", {"prompt": prompt, "max_tokens": 5, "temperature": 0, "echo": True,
                                           "logprobs": 2, "ignore_eos": True})
    logprobs = body["choices"][0]["logprobs"]
    raw = torch.log_softmax(model(torch.tensor([greedy])).logits[0].float(), dim=-1)
    names = LogprobTokenNames(codec)  # generated tokens read after those generated before them, as vLLM does
    prompt_names = [codec.token_text(ids[0])] + [names.after(ids[1:i])(ids[i]) for i in range(1, len(ids))]
    generated_names = [names.after(greedy[len(ids):i])(greedy[i]) for i in range(len(ids), len(greedy))]
    assert logprobs["tokens"] == prompt_names + generated_names
    expected = [float(raw[i - 1, greedy[i]]) for i in range(1, len(greedy))]
    assert logprobs["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)
    last_names = names.after(greedy[len(ids):-1])
    assert logprobs["top_logprobs"][-1] == pytest.approx(expected_top(raw[-2], greedy[-1], 2, last_names), abs=1e-4)
