"""Generation for Hugging Face causal LMs: the KV-cached path matches the reference and HF's generate."""

from __future__ import annotations

import pytest
import torch
import transformers

from baige_ray.serving.causal_lm_generation import Generation, SamplingParams, generate_batch

SIZE = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
MAX_CONTEXT = 64
PROMPTS = [[5, 6, 7], [8, 9, 10], [11, 12, 13, 14, 15, 16], [17], [20, 21, 22, 23, 24, 25]]


def llama() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZE))


def qwen2() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SIZE))


MODELS = pytest.mark.parametrize("build", [llama, qwen2], ids=["llama", "qwen2"])


def greedy(new: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=new, temperature=0.0)


def sampled(new: int, seed: int | None, temperature: float = 1.0, top_k: int | None = 40) -> SamplingParams:
    return SamplingParams(max_new_tokens=new, temperature=temperature, top_k=top_k, seed=seed)


def generate(model, prompts, params, *, eos: int | None = None, max_context: int = MAX_CONTEXT, use_cache=True):
    return generate_batch(model, prompts, params, eos_token_id=eos, max_context=max_context, use_cache=use_cache)


@MODELS
def test_cached_greedy_equals_uncached_for_mixed_prompt_lengths(build):
    model = build()
    params = [greedy(new) for new in (8, 12, 5, 10, 1)]
    cached = generate(model, PROMPTS, params)
    uncached = generate(model, PROMPTS, params, use_cache=False)
    assert cached == uncached
    assert [len(g.tokens) for g in cached] == [8, 12, 5, 10, 1]
    assert {g.finish_reason for g in cached} == {"length"}


@MODELS
def test_cached_greedy_equals_hugging_face_generate(build):
    model = build()
    model.generation_config.eos_token_id = None
    new = 10
    results = generate(model, PROMPTS, [greedy(new)] * len(PROMPTS))
    for prompt, result in zip(PROMPTS, results):
        expected = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new, pad_token_id=0)
        assert result.tokens == expected[0, len(prompt) :].tolist()


@MODELS
def test_cached_sampling_equals_uncached_with_the_same_seeds(build):
    model = build()
    params = [sampled(10, seed) for seed in range(len(PROMPTS))]
    assert generate(model, PROMPTS, params) == generate(model, PROMPTS, params, use_cache=False)


def test_same_seed_gives_the_same_sample_and_other_seeds_differ():
    model = llama()
    first = generate(model, [[3, 4]], [sampled(16, seed=5)])[0]
    assert generate(model, [[3, 4]], [sampled(16, seed=5)])[0] == first
    others = {tuple(generate(model, [[3, 4]], [sampled(16, seed=s)])[0].tokens) for s in range(6, 10)}
    assert others != {tuple(first.tokens)}


def test_a_rows_tokens_do_not_depend_on_its_batch():
    model = llama()
    params = [sampled(6, 1), sampled(9, 2, temperature=0.7), greedy(4), sampled(7, 3, top_k=None), sampled(5, 4)]
    together = generate(model, PROMPTS, params)
    alone = [generate(model, [prompt], [p])[0] for prompt, p in zip(PROMPTS, params)]
    assert together == alone


def test_top_k_of_one_is_greedy():
    model = llama()
    assert generate(model, PROMPTS, [sampled(8, seed=None, top_k=1)] * 5) == generate(model, PROMPTS, [greedy(8)] * 5)


def test_eos_stops_a_row_and_is_not_returned():
    model = llama()
    free = generate(model, PROMPTS[:2], [greedy(10)] * 2)
    tokens = free[0].tokens
    cut = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])
    stopped = generate(model, PROMPTS[:2], [greedy(10)] * 2, eos=tokens[cut])
    assert stopped[0] == Generation(tokens=tokens[:cut], finish_reason="stop")
    other = free[1].tokens
    if tokens[cut] in other:
        assert stopped[1] == Generation(tokens=other[: other.index(tokens[cut])], finish_reason="stop")
    else:
        assert stopped[1] == free[1]


def test_eos_as_the_first_token_gives_an_empty_stop():
    model = llama()
    first = generate(model, [[3, 4]], [greedy(5)])[0].tokens[0]
    assert generate(model, [[3, 4]], [greedy(5)], eos=first)[0] == Generation(tokens=[], finish_reason="stop")


def test_a_prompt_and_new_tokens_beyond_max_context_are_refused_not_cut():
    model = llama()
    with pytest.raises(ValueError, match="3 in the prompt and max_new_tokens=14"):
        generate(model, [[3, 4, 5]], [greedy(14)], max_context=16)
    result = generate(model, [[3, 4, 5]], [greedy(13)], max_context=16)[0]  # exactly fits
    assert len(result.tokens) == 13 and result.finish_reason == "length"


def test_the_model_is_left_in_eval_mode():
    model = llama().train()
    generate(model, [[3]], [greedy(1)])
    assert not model.training


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(max_new_tokens=0, temperature=1.0), "max_new_tokens"),
        (dict(max_new_tokens=2, temperature=-1.0), "temperature"),
        (dict(max_new_tokens=2, temperature=float("nan")), "temperature"),
        (dict(max_new_tokens=2, temperature=1.0, top_k=0), "top_k"),
        (dict(max_new_tokens=2, temperature=1.0, seed=-1), "seed"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kwargs)


def test_invalid_batches_are_refused():
    model = llama()
    with pytest.raises(ValueError, match="one per prompt"):
        generate(model, [[1], [2]], [greedy(1)])
    with pytest.raises(ValueError, match=r"prompts \[1\] are empty"):
        generate(model, [[1], []], [greedy(1)] * 2)
    with pytest.raises(ValueError, match="max_context"):
        generate(model, [[1]], [greedy(1)], max_context=1)
    assert generate(model, [], []) == []
