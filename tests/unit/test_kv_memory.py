"""A KV memory budget on the built-in engine (`kv_cache_memory_bytes`): a request that could not fit alone is
refused with the numbers, the engine's context is what the budget holds, requests wait for room, rows that
outgrow it are preempted and recomputed, and the keys and values a step holds stay within the budget while every
request gets its unbounded tokens."""

from __future__ import annotations

import pytest

from baige_ray.models.hf.decoding import HFDecoder
from baige_ray.serving.app import ServeOptions
from baige_ray.serving.causal_lm_generation import SamplingParams
from baige_ray.serving.context_length import openai_budget
from baige_ray.serving.engine import ContinuousBatchingEngine, EngineLimits, generate_all
from baige_ray.serving.requests import RequestError
from tests.hf_helpers import fresh_llama, random_prompts

# The tiny Llama: 4 layers x keys and values x 2 KV heads x 16 dims x 4 bytes = 1,024 bytes a token. A
# request of 64 tokens alone takes a pool of 5 blocks of 16 (the padding block included) and two dense
# views of 64 columns: (80 + 128) x 1,024 bytes.
BUDGET = 208 * 1024


@pytest.fixture(scope="module")
def llama():
    return fresh_llama()


def engine(llama, budget=BUDGET, max_batch_size=4):
    return ContinuousBatchingEngine(HFDecoder(llama, 128), eos_token_id=None,
                                    limits=EngineLimits(max_batch_size=max_batch_size, kv_cache_memory_bytes=budget))


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)


def test_a_request_the_budget_cannot_hold_is_refused_with_the_numbers_and_the_context_is_what_it_holds(llama):
    bounded = engine(llama)
    assert bounded.max_context == 64 and engine(llama, budget=None).max_context == 128
    assert bounded.context_limit.startswith("This replica's KV cache holds at most 64 tokens for one request "
                                            "(kv_cache_memory_bytes=212,992, 0.2 MiB, at 1,024 bytes a token: 4 "
                                            "layers x keys and values x 2 KV heads x 16 dims x 4 bytes")
    (prompt,) = random_prompts((60,), seed=1)
    with pytest.raises(ValueError, match=r"you requested 65 tokens: 60 in the prompt and 5 to generate, which "
                                         r"need 0\.2 MiB"):
        bounded.submit(prompt, greedy(5), lambda event: None)
    assert bounded.num_waiting == 0
    # A replica's OpenAI routes, as vLLM's server: max_tokens past the context generates up to its end (here,
    # what the budget holds), and a prompt that leaves no room is a 400 naming the budget's numbers.
    assert openai_budget(prompt, max_tokens=5, max_context=bounded.max_context,
                         limit=bounded.context_limit) == (prompt, 4)
    with pytest.raises(RequestError) as refused:
        openai_budget(prompt + prompt[:10], max_tokens=5, max_context=bounded.max_context,
                      limit=bounded.context_limit)
    assert refused.value.status == 400 and str(refused.value).startswith(bounded.context_limit + ". However, your "
                                                                          "prompt contains 70 input tokens")


def test_rows_that_outgrow_the_budget_are_preempted_and_recomputed_with_the_unbounded_tokens(llama):
    prompts = random_prompts((20, 20, 18, 22, 12), seed=2)
    params = [greedy(20), SamplingParams(max_new_tokens=20, temperature=0.9, seed=7), greedy(12), greedy(8),
              greedy(40)]  # the sampled one draws from its own random stream, preempted or not
    unbounded = generate_all(engine(llama, budget=None), prompts, params)
    bounded = engine(llama)
    bytes_per_token = 1024
    outputs = [[] for _ in prompts]
    for prompt, sampling, out in zip(prompts, params, outputs):
        bounded.submit(prompt, sampling, out.append)
    most_running = 0
    while bounded.step():
        most_running = max(most_running, bounded.num_running)
        cache = bounded._cache
        views = 2 * cache.num_rows * cache.num_columns * bytes_per_token
        assert cache.pool_bytes + views <= BUDGET
    # Two rows of about 21 tokens are admitted ((5 blocks x 16 + 2 x 2 x 21) x 1,024 bytes); past 32 tokens each
    # needs a third block and the newer one leaves the batch, to be recomputed once there is room.
    assert most_running == 2 and bounded.preemptions >= 1
    assert [[event.token for event in out if event.token is not None] for out in outputs] == \
        [generation.tokens for generation in unbounded]
    assert all(out[-1].finish_reason == "length" for out in outputs)


def test_vllm_sizes_its_own_cache_with_the_budget():
    from baige_ray.serving.vllm_engine import VLLMSettings, engine_arguments

    settings = VLLMSettings(model_dir="/models/llama", max_context=4096)
    bounded = engine_arguments(settings, EngineLimits(kv_cache_memory_bytes=1 << 30), load_format="dummy")
    assert bounded["kv_cache_memory_bytes"] == 1 << 30 and bounded["max_model_len"] == 4096
    assert "kv_cache_memory_bytes" not in engine_arguments(settings, EngineLimits(), load_format="dummy")


def test_the_budget_is_validated_where_it_is_given():
    with pytest.raises(ValueError, match="EngineLimits.kv_cache_memory_bytes"):
        EngineLimits(kv_cache_memory_bytes=0)
    with pytest.raises(ValueError, match="ServeOptions.kv_cache_memory_bytes"):
        ServeOptions(kv_cache_memory_bytes=-1)


def test_a_replicas_routes_serve_the_context_the_budget_holds_and_give_its_numbers():
    """The OpenAI routes and /generate of a replica (no Ray: tests/unit/fixtures/openai_server.py) on an engine
    whose budget holds 32 of the model's 64 tokens: the reference GPT's 256 bytes a token (1 layer x keys and
    values x 2 heads x 16 dims x 4 bytes), a pool of 3 blocks and two views of 32 columns."""
    import torch

    from baige_ray.models.gpt import GPT
    from baige_ray.models.gpt_decoding import ByteCodec, GPTDecoder
    from baige_ray.serving.engine_runner import EngineRunner
    from tests.unit.fixtures.openai_server import CONFIG, call, make_server, stop_server

    torch.manual_seed(0)
    engine = ContinuousBatchingEngine(GPTDecoder(GPT(CONFIG).eval()), eos_token_id=None,
                                      limits=EngineLimits(max_batch_size=4, kv_cache_memory_bytes=112 * 256))
    server = make_server(runner=EngineRunner(engine, ByteCodec()))
    try:
        assert call(server, "v1/models")[1]["data"][0]["max_model_len"] == 32
        status, body = call(server, "v1/completions", {"prompt": "x" * 40, "max_tokens": 4})
        assert status == 400 and body["error"]["message"].startswith(
            "This replica's KV cache holds at most 32 tokens for one request (kv_cache_memory_bytes=28,672")
        status, body = call(server, "generate", {"prompt": "x" * 20, "max_new_tokens": 20})
        assert status == 400 and "you requested 40 tokens: 20 in the prompt" in body["error"]
        status, body = call(server, "v1/completions", {"prompt": "x" * 20, "max_tokens": 30, "temperature": 0})
        assert status == 200 and body["usage"]["completion_tokens"] == 12  # to the end of what the budget holds
    finally:
        stop_server(server)
