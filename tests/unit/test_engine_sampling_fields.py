"""The built-in engine with every sampling field: greedy tokens against a plain-torch generation loop that applies
vLLM's rules to the reference GPT's full forward (no cache, no engine), log-probabilities against the same
forward, the prompt's log-probabilities with a prefix cache that holds the prompt, and prefill/decode
disaggregation giving the colocated engine's tokens and figures."""

from __future__ import annotations

import pytest
import torch

from baige_ray.models.gpt import GPT, GPTConfig
from baige_ray.models.gpt_decoding import GPTDecoder
from baige_ray.serving.engine import ContinuousBatchingEngine, EngineLimits, TokenEvent, generate_all
from baige_ray.serving.kv_blocks import KVCacheConfig, PrefixBlockStore
from baige_ray.serving.prefill import PrefillEngine, generate_disaggregated
from baige_ray.serving.sampling_params import SamplingParams

CONFIG = GPTConfig(seq_len=64, num_layers=1, num_heads=2, hidden=32)
PROMPT = list(b"def fib(n): return ")


@pytest.fixture(scope="module")
def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG).eval()


def params(**fields) -> SamplingParams:
    return SamplingParams(**{"max_new_tokens": 12, "temperature": 0.0, **fields})


@torch.no_grad()
def reference_greedy(model: GPT, prompt: list[int], p: SamplingParams, eos: int | None) -> list[int]:
    """Greedy tokens with vLLM's rules written out on the full forward of every step."""
    tokens, output = list(prompt), []
    while len(output) < p.max_new_tokens:
        logits = model(torch.tensor([tokens]))[0, -1].float().clone()
        if len(output) < p.min_tokens:
            logits[[*p.stop_token_ids, *([] if eos is None else [eos])]] = float("-inf")
        for token, bias in p.logit_bias:
            logits[token] += bias
        for token in set(prompt) | set(output):
            logits[token] = logits[token] / p.repetition_penalty if logits[token] > 0 \
                else logits[token] * p.repetition_penalty
        for token in set(output):
            logits[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
        token = int(torch.argmax(logits))
        if token == eos and not p.ignore_eos:
            break
        tokens.append(token)
        output.append(token)
    return output


@pytest.mark.parametrize("fields", [
    dict(repetition_penalty=1.8), dict(presence_penalty=-2.0, frequency_penalty=0.5), dict(frequency_penalty=-1.0),
    dict(logit_bias=((ord("x"), 2.0), (ord(" "), -3.0))), dict(repetition_penalty=0.7, logit_bias=((ord("a"), 1.0),)),
])
def test_greedy_tokens_with_penalties_and_biases_equal_the_plain_torch_loop(gpt, fields):
    p = params(**fields)
    (engine,) = generate_all(ContinuousBatchingEngine(GPTDecoder(gpt), eos_token_id=None), [PROMPT], [p])
    assert engine.tokens == reference_greedy(gpt, PROMPT, p, None)
    assert engine.tokens != generate_all(ContinuousBatchingEngine(GPTDecoder(gpt), eos_token_id=None), [PROMPT],
                                         [params()])[0].tokens  # the field did something


def test_min_tokens_holds_end_of_text_and_stop_tokens_back(gpt):
    plain = generate_all(ContinuousBatchingEngine(GPTDecoder(gpt), eos_token_id=None), [PROMPT], [params()])[0].tokens
    eos = plain[0]  # the greedy first token: ends the request at once without min_tokens
    engine = ContinuousBatchingEngine(GPTDecoder(gpt), eos_token_id=eos)
    alone, held = generate_all(engine, [PROMPT, PROMPT], [params(), params(min_tokens=4, stop_token_ids=(plain[1],))])
    assert (alone.tokens, alone.finish_reason) == ([], "stop")
    assert held.tokens[:4] == reference_greedy(gpt, PROMPT, params(min_tokens=4, stop_token_ids=(plain[1],)), eos)[:4]
    assert len(held.tokens) >= 4 and eos not in held.tokens[:4] and plain[1] not in held.tokens[:4]


def test_rows_of_different_fields_decode_together_as_each_decodes_alone(gpt):
    chosen = [params(), params(temperature=0.8, seed=1, top_p=0.7), params(temperature=1.1, seed=2, min_p=0.1),
              params(temperature=0.9, seed=3, top_k=5, presence_penalty=1.0), params(repetition_penalty=1.3),
              params(temperature=0.7, seed=4)]
    prompts = [PROMPT[:5 + row] for row in range(len(chosen))]
    together = generate_all(ContinuousBatchingEngine(GPTDecoder(gpt), eos_token_id=None), prompts, chosen)
    alone = [generate_all(ContinuousBatchingEngine(GPTDecoder(gpt), eos_token_id=None), [prompt], [p])[0]
             for prompt, p in zip(prompts, chosen)]
    assert together == alone


@torch.no_grad()
def test_sampled_and_prompt_log_probabilities_are_the_forwards_even_with_the_prompt_cached(gpt):
    store = PrefixBlockStore(KVCacheConfig(block_tokens=4), torch.device("cpu"), namespace="gpt@v1")
    engine = ContinuousBatchingEngine(GPTDecoder(gpt), eos_token_id=None, limits=EngineLimits(max_batch_size=2),
                                      prefixes=store)
    generate_all(engine, [PROMPT], [params(max_new_tokens=2)])  # its blocks are now cached
    assert engine.known_prefix_tokens(PROMPT) >= 16
    events: list[TokenEvent] = []
    engine.submit(PROMPT, params(num_logprobs=3, prompt_logprobs=2, echo=True, presence_penalty=0.5), events.append)
    while engine.step():
        pass
    sampled = [event.token for event in events if event.token is not None]
    raw = torch.log_softmax(gpt(torch.tensor([PROMPT + sampled]))[0].float(), dim=-1)
    scores = events[0].prompt_logprobs
    assert scores[0] is None and len(scores) == len(PROMPT)
    for position, entry in enumerate(scores[1:], start=1):
        assert entry[0][0] == PROMPT[position] and len(entry) in (2, 3)
        assert entry[0][1] == pytest.approx(float(raw[position - 1, PROMPT[position]]), abs=1e-4)
        assert [t for t, _ in entry[1:]] == [t for t in torch.topk(raw[position - 1], 2).indices.tolist()
                                             if t != PROMPT[position]][:len(entry) - 1]
    for step, event in enumerate(event for event in events if event.token is not None):
        position = len(PROMPT) - 1 + step
        assert event.logprobs[0] == (event.token, pytest.approx(float(raw[position, event.token]), abs=1e-4))
    assert all(event.prompt_logprobs is None for event in events[1:])


def test_disaggregated_requests_get_the_colocated_tokens_and_figures(gpt):
    chosen = [params(temperature=0.9, seed=5, top_p=0.8, repetition_penalty=1.2, num_logprobs=2, log_probs=True),
              params(min_tokens=3, logit_bias=((ord("z"), 1.5),), prompt_logprobs=1, num_logprobs=1, echo=True)]
    prompts = [PROMPT, PROMPT[:9]]
    colocated = generate_all(ContinuousBatchingEngine(GPTDecoder(gpt), eos_token_id=None), prompts, chosen)
    hand_offs = []
    split = generate_disaggregated(PrefillEngine(GPTDecoder(gpt), eos_token_id=None),
                                   ContinuousBatchingEngine(GPTDecoder(gpt), eos_token_id=None), prompts, chosen,
                                   hand_offs=hand_offs)
    assert [(g.tokens, g.finish_reason) for g in split] == [(g.tokens, g.finish_reason) for g in colocated]
    for mine, theirs in zip(split, colocated):  # rows batched differently: the last bits may differ
        assert mine.log_probs == (None if theirs.log_probs is None else pytest.approx(theirs.log_probs, abs=1e-5))
    scored = next(hand_off for hand_off in hand_offs if hand_off.params.prompt_logprobs is not None)
    assert len(scored.prompt_logprobs) == 9 and scored.first_logprobs[0][0] == scored.first_token
