"""The continuous-batching engine: same tokens as unbatched generation without a cache, rows joining
and leaving at any step, cancellation and a bounded queue. A tiny Llama (transformers) and the
reference GPT, both built from configs."""

from __future__ import annotations

import pytest
import torch

from baige_ray.models.gpt import GPT, GPTConfig
from baige_ray.models.gpt_decoding import GPTDecoder
from baige_ray.models.gpt_decoding import generate_batch as sampler_generate_batch
from baige_ray.models.hf.decoding import HFDecoder
from baige_ray.models.moe import MoEConfig
from baige_ray.serving.causal_lm_generation import SamplingParams, generate_batch
from baige_ray.serving.engine import ContinuousBatchingEngine, EngineFull, EngineLimits, TokenEvent, generate_all
from baige_ray.serving.requests import GenerateRequest
from tests.hf_helpers import fresh_llama, random_prompts

PROMPT_LENGTHS = (3, 17, 1, 9, 30, 5, 12, 2)
NEW_TOKENS = (20, 7, 33, 12, 25, 40, 3, 18)


@pytest.fixture(scope="module")
def llama():
    return fresh_llama()


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(PROMPT_LENGTHS, seed=1)


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)


def uncached_one_by_one(model, prompts, params, eos_token_id=None):
    return [generate_batch(model, [prompt], [p], eos_token_id=eos_token_id, max_context=128, use_cache=False)[0]
            for prompt, p in zip(prompts, params)]


@pytest.mark.parametrize("max_batch_size", [1, 3, 8])
def test_greedy_tokens_equal_uncached_unbatched_generation_for_mixed_prompt_lengths(llama, prompts, max_batch_size):
    params = [greedy(n) for n in NEW_TOKENS]
    engine = ContinuousBatchingEngine(HFDecoder(llama, 128), eos_token_id=None,
                                      limits=EngineLimits(max_batch_size=max_batch_size))
    assert generate_all(engine, prompts, params) == uncached_one_by_one(llama, prompts, params)


def test_requests_joining_a_running_batch_mid_generation_get_the_same_tokens(llama, prompts):
    params = [greedy(n) for n in NEW_TOKENS]
    expected = uncached_one_by_one(llama, prompts, params)
    engine = ContinuousBatchingEngine(HFDecoder(llama, 128), eos_token_id=None, limits=EngineLimits(max_batch_size=4))
    tokens: dict[int, list[int]] = {index: [] for index in range(len(prompts))}

    def sink(index):
        return lambda event: tokens[index].append(event.token) if event.token is not None else None

    for index in range(len(prompts)):  # one new request every 3 steps, while the earlier ones run
        engine.submit(prompts[index], params[index], sink(index))
        for _ in range(3):
            engine.step()
    while engine.step():
        pass
    assert [tokens[index] for index in range(len(prompts))] == [generation.tokens for generation in expected]


def test_one_prompts_samplings_share_one_prefill_and_draw_as_if_each_ran_alone(llama, prompts):
    """An RL group: one forward over the prompt for all of its samplings, each drawing its own tokens."""
    sampled = [SamplingParams(max_new_tokens=6, temperature=1.0, top_k=None, seed=seed, log_probs=True)
               for seed in range(5)]
    alone = [generate_all(ContinuousBatchingEngine(HFDecoder(llama, 128), eos_token_id=None), [prompts[1]], [p])[0]
             for p in sampled]
    decoder = HFDecoder(llama, 128)
    widths = []
    forward = decoder.forward
    decoder.forward = lambda tokens, *rest: widths.append(tokens.shape) or forward(tokens, *rest)
    together = generate_all(ContinuousBatchingEngine(decoder, eos_token_id=None), [prompts[1]] * 5, sampled)
    assert [g.tokens for g in together] == [g.tokens for g in alone]
    assert len({tuple(g.tokens) for g in together}) > 1  # each its own draw
    for mine, reference in zip(together, alone):
        assert mine.log_probs == pytest.approx(reference.log_probs, abs=1e-5)
    assert widths == [torch.Size([1, len(prompts[1])])] + [torch.Size([5, 1])] * 5  # one prefill, then decode steps


def test_prompts_admitted_together_share_one_left_padded_prefill_with_the_tokens_each_gets_alone(llama, prompts):
    """An RL rollout admits all its groups at once: one prefill forward for all their prompts."""
    chosen = [prompts[0], prompts[1], prompts[3]]  # 3, 17 and 9 tokens
    sampled = [SamplingParams(max_new_tokens=5, temperature=1.0, top_k=None, seed=seed, log_probs=True)
               for seed in range(2 * len(chosen))]
    requests = [prompt for prompt in chosen for _ in range(2)]
    alone = [generate_all(ContinuousBatchingEngine(HFDecoder(llama, 128), eos_token_id=None), [prompt], [p])[0]
             for prompt, p in zip(requests, sampled)]
    decoder = HFDecoder(llama, 128)
    shapes = []
    forward = decoder.forward
    decoder.forward = lambda tokens, *rest: shapes.append(tuple(tokens.shape)) or forward(tokens, *rest)
    together = generate_all(ContinuousBatchingEngine(decoder, eos_token_id=None), requests, sampled)
    assert shapes == [(3, 17)] + [(6, 1)] * 4  # one prefill of the three prompts, then decode steps
    assert [g.tokens for g in together] == [g.tokens for g in alone]
    for mine, reference in zip(together, alone):
        assert mine.log_probs == pytest.approx(reference.log_probs, abs=1e-5)


def test_end_of_text_stops_a_row_and_frees_its_slot(llama, prompts):
    params = [greedy(30) for _ in prompts]
    plain = uncached_one_by_one(llama, prompts, params)
    eos = plain[0].tokens[4]  # make a token the first request samples early the end of text
    expected = uncached_one_by_one(llama, prompts, params, eos_token_id=eos)
    engine = ContinuousBatchingEngine(HFDecoder(llama, 128), eos_token_id=eos, limits=EngineLimits(max_batch_size=2))
    got = generate_all(engine, prompts, params)
    assert got == expected and got[0].finish_reason == "stop" and len(got[0].tokens) < 30


def test_sampled_tokens_depend_on_the_seed_not_on_the_batch(llama, prompts):
    params = [SamplingParams(max_new_tokens=10, temperature=0.9, seed=index) for index in range(len(prompts))]
    alone = [generate_all(ContinuousBatchingEngine(HFDecoder(llama, 128), eos_token_id=None), [p], [s])[0]
             for p, s in zip(prompts, params)]
    together = generate_all(ContinuousBatchingEngine(HFDecoder(llama, 128), eos_token_id=None), prompts, params)
    assert together == alone


def test_sampled_log_probabilities_are_the_models_own_teacher_forced_ones_end_of_text_included(llama, prompts):
    """What an RL loss takes as the sampling policy's: the raw log-softmax at each sampled token (no
    temperature), the stopping end-of-text token's last; the reference scorer computes the same."""
    from baige_ray.rl.reference import sequence_log_probs

    params = [SamplingParams(max_new_tokens=12, temperature=0.7, top_k=None, seed=index, log_probs=True)
              for index in range(len(prompts))]
    plain = generate_all(ContinuousBatchingEngine(HFDecoder(llama, 128), eos_token_id=None), prompts, params)
    eos = plain[1].tokens[3]
    got = generate_all(ContinuousBatchingEngine(HFDecoder(llama, 128), eos_token_id=eos,
                                                limits=EngineLimits(max_batch_size=3)), prompts, params)
    assert got[1].finish_reason == "stop"
    sampled = [g.tokens + ([eos] if g.finish_reason == "stop" else []) for g in got]
    assert [len(g.log_probs) for g in got] == [len(tokens) for tokens in sampled]
    forced = sequence_log_probs(llama, [p + t for p, t in zip(prompts, sampled)], [len(p) for p in prompts])
    for engine_figures, teacher_forced in zip((g.log_probs for g in got), forced):
        torch.testing.assert_close(torch.tensor(engine_figures), torch.tensor(teacher_forced), rtol=0, atol=1e-4)
    assert all(g.log_probs is None for g in generate_all(ContinuousBatchingEngine(HFDecoder(llama, 128),
                                                                                  eos_token_id=None),
                                                         prompts[:1], [greedy(3)]))


def test_an_idle_engine_gives_its_batch_memory_back_and_a_request_wakes_it_with_the_same_tokens(llama, prompts):
    params = [SamplingParams(max_new_tokens=8, temperature=0.8, seed=index) for index in range(3)]
    engine = ContinuousBatchingEngine(HFDecoder(llama, 128), eos_token_id=None)
    first = generate_all(engine, prompts[:3], params)
    engine.submit(prompts[0], params[0], lambda event: None)
    with pytest.raises(RuntimeError, match="0 running and 1 waiting"):
        engine.sleep()
    while engine.step():
        pass
    released = engine.sleep()
    assert released > 0 and engine.asleep and engine.sleep() == 0  # the batch's pool; on the host no weights move
    assert generate_all(engine, prompts[:3], params) == first and not engine.asleep


@pytest.mark.parametrize("moe", [None, MoEConfig(num_experts=4, top_k=2)], ids=["dense", "moe"])
def test_the_reference_gpt_with_a_cache_matches_todays_sampler(moe):
    """Dense, and with routed experts: routing is per token, so batching and padding change nothing."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=64, num_layers=2, num_heads=2, hidden=32, moe=moe)).eval()
    texts, new_tokens = ["def ", "import os\n", "x", "class Foo(object):\n    "], (10, 30, 5, 20)
    requests = [GenerateRequest(prompt=t, max_new_tokens=n, temperature=0.0) for t, n in zip(texts, new_tokens)]
    expected = [sampler_generate_batch(model, [request])[0] for request in requests]
    engine = ContinuousBatchingEngine(GPTDecoder(model), eos_token_id=None, limits=EngineLimits(max_batch_size=2))
    got = generate_all(engine, [list(t.encode()) for t in texts], [greedy(n) for n in new_tokens])
    assert [generation.tokens for generation in got] == expected


def test_a_prompt_and_new_tokens_beyond_the_context_are_refused_not_cut(llama):
    engine = ContinuousBatchingEngine(HFDecoder(llama, 16), eos_token_id=None)
    with pytest.raises(ValueError, match="39 in the prompt and max_new_tokens=10"):
        engine.submit(list(range(1, 40)), greedy(10), lambda event: None)
    assert engine.num_waiting == 0
    (generation,) = generate_all(engine, [list(range(1, 7))], [greedy(10)])  # 6 + 10: exactly the context
    assert len(generation.tokens) == 10 and generation.finish_reason == "length"


def test_a_cancelled_request_leaves_the_batch_and_gets_no_more_events(llama, prompts):
    engine = ContinuousBatchingEngine(HFDecoder(llama, 128), eos_token_id=None)
    events: list[TokenEvent] = []
    first = engine.submit(prompts[0], greedy(50), events.append)
    other: list[TokenEvent] = []
    engine.submit(prompts[1], greedy(5), other.append)
    engine.step()
    engine.step()
    engine.cancel(first)
    count = len(events)
    while engine.step():
        pass
    assert len(events) == count and engine.num_running == 0
    assert [event.finish_reason for event in other if event.token is None] == ["length"]


def test_a_full_queue_refuses_new_requests(llama, prompts):
    engine = ContinuousBatchingEngine(HFDecoder(llama, 128), eos_token_id=None,
                                      limits=EngineLimits(max_batch_size=1, max_waiting=2))
    for prompt in prompts[:2]:
        engine.submit(prompt, greedy(3), lambda event: None)
    with pytest.raises(EngineFull, match="already waiting"):
        engine.submit(prompts[2], greedy(3), lambda event: None)
    with pytest.raises(ValueError, match="empty"):
        ContinuousBatchingEngine(HFDecoder(llama, 128), eos_token_id=None).submit([], greedy(3), lambda e: None)


@pytest.mark.parametrize(("field", "value"), [("max_batch_size", 0), ("max_waiting", -1)])
def test_engine_limits_name_the_invalid_field(field, value):
    with pytest.raises(ValueError, match=f"EngineLimits.{field}"):
        EngineLimits(**{field: value})


def test_a_call_between_steps_ends_an_idle_engines_wait_even_one_that_has_not_begun():
    """A refit or a sleep asked of an idle replica runs at once, not when the idle wait times out."""
    import time

    from baige_ray.serving.engine import RequestQueue

    queue = RequestQueue(max_waiting=4)
    queue.interrupt()  # before the engine's thread waits: the next wait does not sleep
    started = time.monotonic()
    queue.wait(30.0, busy=False)
    assert time.monotonic() - started < 10.0
    started = time.monotonic()
    queue.wait(0.2, busy=False)  # the interrupt was used up: an idle wait sleeps again
    assert time.monotonic() - started >= 0.2
