"""Each sampling field of the built-in engine (models/logits_processing.py, serving/row_sampling.py) against a
reference written out row by row in plain torch on the same logits, in vLLM's order; and a row at neutral
values drawing exactly what the plain sampler draws for its seed, alone or beside rows that ask for more."""

from __future__ import annotations

import math

import pytest
import torch

from baige_ray.models.generation import sample_token, sample_tokens, seeded_generator
from baige_ray.models.logits_processing import narrowed, needs_processing, process_logits, sample_processed
from baige_ray.serving.row_sampling import sample_rows
from baige_ray.serving.sampling_params import SamplingParams
from baige_ray.serving.token_logprobs import prompt_logprobs, ranked

VOCAB = 64
EOS = 7


class Row:
    def __init__(self, params: SamplingParams, prompt=(), sampled=(), seed: int = 0):
        self.params, self.prompt, self.sampled = params, list(prompt), list(sampled)
        self.generator = seeded_generator(seed)


def params(**fields) -> SamplingParams:
    return SamplingParams(**{"max_new_tokens": 16, **fields})


def logits_of(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


# -- references, one row at a time ------------------------------------------------------------------------
def reference_penalised(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    out = logits.clone()
    for token in range(VOCAB):
        count = output.count(token)
        if token in prompt or count:
            out[token] = out[token] / p.repetition_penalty if out[token] > 0 else out[token] * p.repetition_penalty
        out[token] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return out


def reference_top_p_kept(probs: torch.Tensor, top_p: float) -> set[int]:
    """The smallest set of likeliest tokens whose mass reaches top_p (vLLM drops the tail of mass <= 1 - top_p)."""
    order = sorted(range(len(probs)), key=lambda t: -float(probs[t]))
    kept, mass = set(), 0.0
    for token in order:
        kept.add(token)
        mass += float(probs[token])
        if mass >= top_p - 1e-6:
            return kept
    return kept


def allowed(row_logits: torch.Tensor) -> set[int]:
    return {token for token in range(VOCAB) if row_logits[token] > float("-inf")}


# -- each field ---------------------------------------------------------------------------------------------
def test_penalties_follow_vllm_over_the_prompt_and_the_output_so_far():
    logits = logits_of(3)
    prompt, output = [1, 2, 3, 3], [3, 5, 5, 9]
    chosen = [params(repetition_penalty=1.3), params(frequency_penalty=0.7, presence_penalty=-0.4),
              params(repetition_penalty=0.8, frequency_penalty=-1.5, presence_penalty=2.0)]
    processed = process_logits(logits, [Row(p, prompt, output) for p in chosen], EOS)
    for row, p in enumerate(chosen):
        torch.testing.assert_close(processed[row], reference_penalised(logits[row], p, prompt, output),
                                   rtol=1e-6, atol=1e-6)
    untouched = [token for token in range(VOCAB) if token not in prompt + output]
    assert torch.equal(processed[:, untouched], logits[:, untouched])


def test_logit_bias_is_added_and_applied_before_the_penalties():
    logits = torch.zeros(1, VOCAB)
    logits[0, 4] = -1.0
    biased = params(logit_bias=((4, 3.0), (6, -100.0)), repetition_penalty=2.0)
    processed = process_logits(logits, [Row(biased, prompt=[4])], EOS)[0]
    assert processed[4] == pytest.approx(2.0 / 2.0)  # -1 + 3 = 2, then divided: positive after the bias
    assert processed[6] == -100.0 and processed[5] == 0.0


def test_min_tokens_masks_the_stop_tokens_and_end_of_text_until_reached_even_with_ignore_eos():
    logits = logits_of(3)
    waiting = params(min_tokens=2, stop_token_ids=(11, 12))
    rows = [Row(waiting, sampled=[1]), Row(waiting, sampled=[1, 2]), Row(params(min_tokens=2, ignore_eos=True))]
    processed = process_logits(logits, rows, EOS)
    assert allowed(processed[0]) == set(range(VOCAB)) - {EOS, 11, 12}
    assert torch.equal(processed[1], logits[1])  # two tokens already: nothing masked
    assert allowed(processed[2]) == set(range(VOCAB)) - {EOS}  # vLLM masks EOS under min_tokens regardless
    assert [needs_processing(row) for row in rows] == [True, False, True]


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.75, 0.95])
def test_top_p_keeps_the_smallest_set_of_likeliest_tokens_holding_that_mass(top_p):
    logits = logits_of(4, seed=3)
    temperature = 0.8
    kept = narrowed(logits.clone(), [params(temperature=temperature, top_p=top_p)] * 4)
    for row in range(4):
        probs = torch.softmax(logits[row] / temperature, dim=-1)
        assert allowed(kept[row]) == reference_top_p_kept(probs, top_p)
        survivors = list(allowed(kept[row]))
        torch.testing.assert_close(kept[row, survivors], logits[row, survivors] / temperature)


def test_min_p_drops_tokens_less_likely_than_that_share_of_the_likeliest():
    logits = logits_of(2, seed=4)
    kept = narrowed(logits.clone(), [params(temperature=1.5, min_p=0.2), params(temperature=1.5)])
    probs = torch.softmax(logits / 1.5, dim=-1)
    assert allowed(kept[0]) == {t for t in range(VOCAB) if probs[0, t] >= 0.2 * probs[0].max()}
    assert allowed(kept[1]) == set(range(VOCAB))


def test_top_k_then_top_p_narrow_in_vllms_order():
    logits = logits_of(1, seed=5)
    kept = narrowed(logits.clone(), [params(top_k=10, top_p=0.5)])[0]
    top10 = torch.topk(logits[0], 10).indices.tolist()
    probs = torch.zeros(VOCAB)
    probs[top10] = torch.softmax(logits[0, top10], dim=-1)  # top-p over what top-k kept
    assert allowed(kept) == reference_top_p_kept(probs, 0.5)


def test_draws_follow_the_narrowed_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (VOCAB - 4)]))
    rows = [Row(params(top_p=0.7), seed=seed) for seed in range(400)]
    tokens = sample_processed(process_logits(logits.expand(len(rows), -1), rows, EOS), rows)
    assert set(tokens) == {0, 1}  # 0.5 + 0.3 reaches 0.7; the rest is cut
    assert 0.5 < tokens.count(0) / len(tokens) < 0.75  # 0.5 / 0.8 = 0.625


def test_greedy_rows_take_the_argmax_after_penalties_bias_and_min_tokens():
    logits = torch.zeros(3, VOCAB)
    logits[:, EOS], logits[:, 3] = 5.0, 4.0
    rows = [Row(params(temperature=0.0, min_tokens=1)),
            Row(params(temperature=0.0, presence_penalty=2.0), sampled=[EOS]),
            Row(params(temperature=0.0, logit_bias=((9, 6.0),)))]
    assert [s.token for s in sample_rows(logits, rows, EOS)] == [3, 3, 9]
    assert [s.token for s in sample_rows(logits[:1], [Row(params(temperature=0.0, top_p=0.01))], EOS)] == [EOS]


# -- neutral rows: today's tokens, bit for bit ---------------------------------------------------------------
@pytest.mark.parametrize(("temperature", "top_k"), [(1.0, None), (0.7, 5), (0.0, None)])
def test_neutral_rows_draw_what_the_plain_sampler_draws(temperature, top_k):
    logits = logits_of(8, seed=6)
    neutral = params(temperature=temperature, top_k=top_k, top_p=1.0, min_p=0.0, repetition_penalty=1.0)
    rows = [Row(neutral, prompt=[1, 2], sampled=[3], seed=seed) for seed in range(8)]
    assert not any(needs_processing(row) for row in rows)
    plain = sample_tokens(logits, temperature, [seeded_generator(seed) for seed in range(8)], top_k)
    assert [s.token for s in sample_rows(logits, rows, EOS)] == plain


def test_neutral_rows_beside_rows_that_ask_for_more_still_draw_their_own_tokens():
    logits = logits_of(6, seed=7)
    rows = [Row(params(temperature=0.9, top_k=8 if row % 2 else None), prompt=[row], sampled=[row + 1], seed=row)
            for row in range(6)]
    rows[2] = Row(params(temperature=0.6, top_p=0.8, presence_penalty=1.0), sampled=[4], seed=2)
    rows[4] = Row(params(temperature=0.0, repetition_penalty=1.5), prompt=[1], seed=4)
    tokens = [s.token for s in sample_rows(logits, rows, EOS)]
    for row in (0, 1, 3, 5):
        p = rows[row].params
        assert tokens[row] == sample_token(logits[row], p.temperature, seeded_generator(row), p.top_k)


def test_the_plain_batch_costs_no_log_softmax_and_asks_no_figures():
    sampled = sample_rows(logits_of(2), [Row(params(), seed=1), Row(params(), seed=2)], EOS)
    assert all(s.log_prob is None and s.logprobs is None for s in sampled)


# -- log-probabilities ------------------------------------------------------------------------------------------
def test_log_probabilities_are_the_raw_ones_with_the_sampled_token_first_then_the_likeliest():
    logits = logits_of(2, seed=8)
    rows = [Row(params(temperature=0.0, num_logprobs=3, repetition_penalty=2.0), prompt=list(range(VOCAB))),
            Row(params(log_probs=True), seed=3)]
    first, second = sample_rows(logits, rows, EOS)
    raw = torch.log_softmax(logits, dim=-1)  # before the penalty the first row's token was drawn after
    top3 = torch.topk(raw[0], 3).indices.tolist()
    assert first.logprobs[0] == (first.token, pytest.approx(float(raw[0, first.token])))
    assert [token for token, _ in first.logprobs[1:]] == [t for t in top3 if t != first.token]
    assert first.log_prob is None and second.logprobs is None
    assert second.log_prob == pytest.approx(float(raw[1, second.token]))


def test_ranked_and_prompt_entries():
    log_probs = torch.log_softmax(logits_of(3, seed=9), dim=-1)
    best = int(log_probs[0].argmax())
    (entry,) = ranked(log_probs[:1], [best], [2])
    assert len(entry) == 2 and entry[0][0] == best  # the sampled token among the top two: listed once
    (whole,) = ranked(log_probs[1:2], [0], [-1])
    assert len(whole) == VOCAB and sum(math.exp(value) for _, value in whole) == pytest.approx(1.0, abs=1e-4)
    scores = prompt_logprobs(logits_of(3, seed=9), [5, 6, 7], 1)
    assert scores[0] is None and [entry[0][0] for entry in scores[1:]] == [6, 7]
    assert scores[2][0][1] == pytest.approx(float(log_probs[1, 7]))
