"""Prefill/decode disaggregation at the engine level: a prompt prefilled on one engine and decoded on
another gets the tokens one colocated engine gives it (greedy and seeded sampling, mixed prompt
lengths, the reference GPT and a tiny Llama); the hand-off survives pickling (Ray's object store)
and carries only its own row; and the serving options are validated."""

from __future__ import annotations

import pickle

import pytest
import torch

from baige_ray.models.gpt import GPT, GPTConfig
from baige_ray.models.gpt_decoding import GPTDecoder
from baige_ray.models.hf.decoding import HFDecoder
from baige_ray.serving.app import ServeOptions
from baige_ray.serving.causal_lm_generation import SamplingParams
from baige_ray.serving.disaggregation import DisaggregationOptions
from baige_ray.serving.engine import (
    ContinuousBatchingEngine,
    EngineLimits,
    GenerationCollector,
    PrefilledRequest,
    TokenEvent,
    generate_all,
)
from baige_ray.serving.prefill import PrefillEngine, generate_disaggregated
from tests.hf_helpers import VOCAB_SIZE, llama_config

# Equal lengths (9, 9, 9) share a prefill forward; a budget of 1 ends at the prefill.
PROMPT_LENGTHS = (3, 17, 1, 9, 30, 9, 12, 2, 9, 5)
NEW_TOKENS = (20, 7, 33, 12, 25, 40, 3, 1, 18, 9)


@pytest.fixture(scope="module")
def decoders():
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    llama = AutoModelForCausalLM.from_config(llama_config(), dtype=torch.float32).eval()
    gpt = GPT(GPTConfig(seq_len=64, num_layers=2, num_heads=2, hidden=32)).eval()
    return {"llama": HFDecoder(llama, 128), "gpt": GPTDecoder(gpt)}


def prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def sampling(temperature: float) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=n, temperature=temperature, seed=index)
            for index, n in enumerate(NEW_TOKENS)]


@pytest.mark.parametrize("model", ["gpt", "llama"])
@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "seeded"])
def test_prefill_on_one_engine_and_decode_on_another_gives_the_colocated_tokens(decoders, model, temperature):
    decoder = decoders[model]
    inputs, params = prompts(VOCAB_SIZE if model == "llama" else 256), sampling(temperature)
    def decode_engine() -> ContinuousBatchingEngine:
        return ContinuousBatchingEngine(decoder, eos_token_id=None, limits=EngineLimits(max_batch_size=4))

    colocated = generate_all(decode_engine(), inputs, params)
    # Three prompts per prefill step: later ones join the decode batch while earlier ones decode.
    prefill = PrefillEngine(decoder, eos_token_id=None, limits=EngineLimits(max_batch_size=3))
    split = generate_disaggregated(prefill, decode_engine(), inputs, params)
    assert split == colocated
    assert [len(generation.tokens) for generation in split] == list(NEW_TOKENS)


def test_a_pickled_hand_off_carries_only_its_own_row_and_decodes_the_same(decoders):
    decoder, params = decoders["gpt"], sampling(0.9)[:3]
    inputs = [list(b"def f(x):"), list(b"import os"), list(b"class A:")]
    handed: list[PrefilledRequest] = []
    prefill = PrefillEngine(decoder, eos_token_id=None)
    for prompt, request_params in zip(inputs, params):
        prefill.submit(prompt, request_params, handed.append)
    assert prefill.step() and len(handed) == 3  # one forward: the three prompts are 9 tokens each
    row_bytes = sum(keys.numel() * 4 + values.numel() * 4 for keys, values in handed[0].kv)
    state_bytes = handed[0].generator_state.numel()
    assert len(pickle.dumps(handed[0])) < 2 * row_bytes + state_bytes + 2048  # the group's cache is 3 rows
    decode = ContinuousBatchingEngine(decoder, eos_token_id=None)
    tokens: list[list[int]] = [[prefilled.first_token] for prefilled in handed]
    for index, prefilled in enumerate(handed):  # as a decode replica receives it from the object store
        sink = (lambda event, index=index: tokens[index].append(event.token) if event.token is not None else None)
        decode.submit_prefilled(pickle.loads(pickle.dumps(prefilled)), sink)
    while decode.step():
        pass
    colocated = generate_all(ContinuousBatchingEngine(decoder, eos_token_id=None), inputs, params)
    assert tokens == [generation.tokens for generation in colocated]


def test_an_end_of_text_first_token_ends_the_request_at_the_prefill(decoders):
    decoder, prompt, greedy = decoders["gpt"], list(b"x = "), SamplingParams(max_new_tokens=10, temperature=0.0)
    (first,) = generate_all(ContinuousBatchingEngine(decoder, eos_token_id=None), [prompt], [greedy])
    handed: list[PrefilledRequest] = []
    prefill = PrefillEngine(decoder, eos_token_id=first.tokens[0])
    prefill.submit(prompt, greedy, handed.append)
    prefill.step()
    assert handed[0].first_events() == [TokenEvent(None, "stop", stop_token=first.tokens[0])] and handed[0].kv == []
    with pytest.raises(ValueError, match="already finished"):
        ContinuousBatchingEngine(decoder, eos_token_id=None).submit_prefilled(handed[0], lambda event: None)


def test_a_hand_off_from_a_longer_context_is_refused_and_a_cancelled_prompt_never_runs(decoders):
    handed: list[PrefilledRequest] = []
    prefill = PrefillEngine(decoders["llama"], eos_token_id=None)
    prefill.submit(list(range(1, 90)), SamplingParams(max_new_tokens=30, temperature=0.0), handed.append)
    cancelled = prefill.submit([1, 2, 3], SamplingParams(max_new_tokens=5, temperature=0.0), handed.append)
    prefill.cancel(cancelled)
    assert prefill.step() and len(handed) == 1 and not prefill.step()
    with pytest.raises(ValueError, match="context of 64"):
        ContinuousBatchingEngine(decoders["gpt"], eos_token_id=None).submit_prefilled(handed[0], lambda event: None)


def test_a_prompt_that_does_not_fit_is_refused_by_the_prefill_engine_not_cut(decoders):
    prefill = PrefillEngine(decoders["gpt"], eos_token_id=None)  # a context of 64
    with pytest.raises(ValueError, match="60 in the prompt and max_new_tokens=5"):
        prefill.submit(list(range(1, 61)), SamplingParams(max_new_tokens=5, temperature=0.0), lambda handed: None)
    assert prefill.num_waiting == 0


@pytest.mark.parametrize(("field", "value"), [("prefill_replicas", 0), ("decode_replicas", 1.5),
                                              ("max_prefill_batch_size", 0), ("split", "even")])
def test_disaggregation_options_name_the_invalid_field(field, value):
    with pytest.raises(ValueError, match=f"DisaggregationOptions.{field}"):
        DisaggregationOptions(**{field: value})


def test_serve_options_refuse_disaggregation_with_vllm_or_a_replica_count():
    with pytest.raises(ValueError, match="ServeOptions.disaggregation.*engine='vllm'.*built-in"):
        ServeOptions(engine="vllm", disaggregation=DisaggregationOptions())
    with pytest.raises(ValueError, match="ServeOptions.num_replicas=2.*prefill_replicas"):
        ServeOptions(num_replicas=2, disaggregation=DisaggregationOptions())
    with pytest.raises(ValueError, match="ServeOptions.disaggregation"):
        ServeOptions(disaggregation={"prefill_replicas": 2})
    assert ServeOptions(disaggregation=DisaggregationOptions(prefill_replicas=2)).disaggregation.prefill_replicas == 2


@pytest.mark.parametrize("model", ["gpt", "llama"])
@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "seeded"])
def test_with_prefix_caches_the_hand_off_carries_only_what_the_decode_side_lacks(decoders, model, temperature):
    from baige_ray.serving.kv_blocks import KVCacheConfig, PrefixBlockStore

    decoder, vocab = decoders[model], VOCAB_SIZE if model == "llama" else 256
    generator = torch.Generator().manual_seed(2)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=generator).tolist()

    def store() -> PrefixBlockStore:
        return PrefixBlockStore(KVCacheConfig(block_tokens=4), torch.device("cpu"), namespace="model@v1")

    system = tokens(12)  # three blocks
    params = [SamplingParams(max_new_tokens=6, temperature=temperature, seed=seed) for seed in (0, 1)]
    prefill = PrefillEngine(decoder, eos_token_id=None, limits=EngineLimits(max_batch_size=2), prefixes=store())
    decode = ContinuousBatchingEngine(decoder, eos_token_id=None, limits=EngineLimits(max_batch_size=4),
                                      prefixes=store())
    first = [system + tokens(3), system + tokens(5)]
    answers = generate_disaggregated(prefill, decode, first, params)
    # Another question on the system prompt, and a chat's next turn (the first prompt, its answer, a message).
    second = [system + tokens(4), first[0] + answers[0].tokens + tokens(3)]
    hand_offs = []
    again = generate_disaggregated(prefill, decode, second, params, hand_offs=hand_offs)

    def uncached() -> ContinuousBatchingEngine:
        return ContinuousBatchingEngine(decoder, eos_token_id=None, limits=EngineLimits(max_batch_size=4))

    assert answers == generate_all(uncached(), first, params) and again == generate_all(uncached(), second, params)
    # The decode side held the system prompt's 3 blocks, and the first turn's prompt and answer (20 tokens).
    assert sorted(hand_off.kv_from for hand_off in hand_offs) == [12, 20]
    assert all(hand_off.kv[0][0].shape[2] == hand_off.prompt_length - hand_off.kv_from for hand_off in hand_offs)
    assert prefill.prefixes.stats.hits["device"] >= 3 + 3  # the prefill side ran both from its own blocks too


def test_blocks_the_decode_side_lost_since_it_said_it_held_them_are_recomputed_there(decoders):
    decoder = decoders["llama"]
    prompt = torch.randint(0, VOCAB_SIZE, (15,), generator=torch.Generator().manual_seed(3)).tolist()
    params = [SamplingParams(max_new_tokens=5, temperature=0.0)]
    prefill = PrefillEngine(decoder, eos_token_id=None)
    decode = ContinuousBatchingEngine(decoder, eos_token_id=None)  # no prefix cache at all: nothing to take
    hand_offs = []
    sink = GenerationCollector(1)
    prefill.submit(prompt, params[0], hand_offs.append, known_tokens=8)  # as if the decode side had held 2 blocks
    prefill.step()
    (hand_off,) = hand_offs
    assert hand_off.kv_from == 8 and hand_off.kv[0][0].shape[2] == 7
    for event in hand_off.first_events():
        sink.sink(0)(event)
    decode.submit_prefilled(hand_off, sink.sink(0))
    while decode.step():
        pass
    assert sink.generations() == generate_all(ContinuousBatchingEngine(decoder, eos_token_id=None), [prompt], params)
