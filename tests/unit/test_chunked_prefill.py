"""Chunked prefill in the built-in engine: a prompt longer than `max_num_batched_tokens` runs a chunk per
step, the running rows decoding between its chunks, and generates the tokens of a whole prefill."""

from __future__ import annotations

import pytest

from baige_ray.models.hf.decoding import HFDecoder
from baige_ray.serving.app import ServeOptions
from baige_ray.serving.causal_lm_generation import SamplingParams
from baige_ray.serving.disaggregation import DisaggregationOptions
from baige_ray.serving.engine import ContinuousBatchingEngine, EngineLimits, generate_all
from tests.hf_helpers import fresh_llama, random_prompts

LONG, SHORT = 100, 5


@pytest.fixture(scope="module")
def llama():
    return fresh_llama()


@pytest.fixture(scope="module")
def prompts():
    return random_prompts((LONG, SHORT, 40, 17), seed=3)


def engine(llama, max_num_batched_tokens=None, max_batch_size=4):
    return ContinuousBatchingEngine(HFDecoder(llama, 128), eos_token_id=None,
                                    limits=EngineLimits(max_batch_size=max_batch_size,
                                                        max_num_batched_tokens=max_num_batched_tokens))


def greedy(max_new_tokens: int, **options) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **options)


def test_chunked_prefill_generates_the_tokens_of_a_whole_prefill(llama, prompts):
    params = [greedy(20), greedy(12), greedy(16), greedy(8)]
    whole = generate_all(engine(llama), prompts, params)
    for budget in (4, 16, 64):
        assert generate_all(engine(llama, budget), prompts, params) == whole, budget


def test_a_short_request_gets_its_first_token_while_a_long_prompt_is_still_prefilling(llama, prompts):
    chunked = engine(llama, max_num_batched_tokens=16)
    steps_to_first: dict[str, int] = {}
    step = 0

    def first(name):
        return lambda event: steps_to_first.setdefault(name, step) if event.token is not None else None

    chunked.submit(prompts[0], greedy(4), first("long"))
    chunked.submit(prompts[1], greedy(4), first("short"))
    while chunked.step():
        step += 1
        assert chunked.num_running <= 2
    # 16 tokens a step, less one for each decoding row: the 100-token prompt needs 7 steps.
    assert steps_to_first == {"short": 0, "long": 6}


def test_prompt_log_probabilities_of_a_chunked_prefill_are_the_whole_ones(llama, prompts):
    params = [greedy(3, prompt_logprobs=2)]
    (whole,) = generate_all(engine(llama), prompts[:1], params)
    events = []
    chunked = engine(llama, max_num_batched_tokens=8)
    chunked.submit(prompts[0], params[0], events.append)
    while chunked.step():
        pass
    expected = []
    reference = engine(llama)
    reference.submit(prompts[0], params[0], expected.append)
    while reference.step():
        pass
    assert [e.token for e in events] == [e.token for e in expected] == whole.tokens + [None]
    got, want = events[0].prompt_logprobs, expected[0].prompt_logprobs
    assert len(got) == LONG and got[0] is None
    for position, (ours, theirs) in enumerate(zip(got[1:], want[1:]), start=1):
        assert [token for token, _ in ours] == [token for token, _ in theirs], position
        assert [value for _, value in ours] == pytest.approx([value for _, value in theirs], abs=1e-5), position


def test_a_request_cancelled_while_its_prompt_prefills_gets_no_events_and_frees_its_slot(llama, prompts):
    chunked = engine(llama, max_num_batched_tokens=8, max_batch_size=1)
    events = []
    request_id = chunked.submit(prompts[0], greedy(4), events.append)
    chunked.step()
    assert chunked.num_running == 1
    chunked.cancel(request_id)
    (after,) = generate_all(chunked, prompts[1:2], [greedy(3)])  # admitted into the freed slot
    assert events == [] and len(after.tokens) == 3 and chunked.num_running == 0


def test_the_step_budget_holds_a_token_of_every_row_and_is_not_for_disaggregation():
    with pytest.raises(ValueError, match="EngineLimits.max_num_batched_tokens"):
        EngineLimits(max_batch_size=8, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="ServeOptions.max_num_batched_tokens"):
        ServeOptions(max_batch_size=8, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="max_num_batched_tokens is invalid with disaggregation"):
        ServeOptions(max_num_batched_tokens=64, disaggregation=DisaggregationOptions())


def test_prompts_prefilled_together_are_batched_by_width_so_padding_at_most_doubles_the_tokens():
    from types import SimpleNamespace

    from baige_ray.serving.engine import batches_of_similar_width

    def group(length):
        return [SimpleNamespace(prompt=[0] * length)]

    batches = batches_of_similar_width([group(n) for n in (2048, 30, 32, 5, 40, 2000)])
    assert [[len(g[0].prompt) for g in batch] for batch in batches] == [[5, 30, 32, 40], [2000, 2048]]
