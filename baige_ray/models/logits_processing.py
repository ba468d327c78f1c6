"""What a request's sampling fields do to a batch's logits before its tokens are drawn, in vLLM's order.

vLLM's sampler (v1, 0.32) first masks and biases: before `min_tokens` tokens the stop tokens and the
end of text cannot be drawn (vLLM masks the end of text then even with `ignore_eos`), and
`logit_bias` is added. Then it penalises: repetition over the prompt and the output so far (a
positive logit divided by the penalty, a negative one multiplied), frequency (minus the penalty times
the token's count in the output) and presence (minus the penalty once for a token the output holds).
Greedy rows take the argmax of that. The others are divided by their temperature, narrowed by min-p
(tokens less likely than `min_p` times the likeliest go), by top-k, then by top-p (the likeliest tokens
that together hold at least `top_p` of the probability stay, the likeliest always), and drawn.

Each step runs on the whole batch at once, a filter only on the rows that set it, so a row at neutral
values comes out bit for bit as it went in and draws what `sample_tokens` draws for it. The fields are
read from any object that has them (serving's SamplingParams does): the models layer imports no serving.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from baige_ray.models.generation import draw_tokens


class SamplingFields(Protocol):
    temperature: float
    top_k: int | None
    top_p: float
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: tuple[tuple[int, float], ...]
    min_tokens: int
    stop_token_ids: tuple[int, ...]


class SamplingRow(Protocol):
    """One request being sampled: how, with which generator, after which prompt and output tokens."""

    params: SamplingFields
    generator: torch.Generator
    prompt: Sequence[int]
    sampled: Sequence[int]  # every token it sampled so far


def needs_processing(row: SamplingRow) -> bool:
    """Whether the row's fields change its logits now (else plain temperature and top-k sampling draws its
    token); top-p and min-p mean nothing to a greedy row, as vLLM resets them at temperature 0."""
    p = row.params
    return (bool(p.logit_bias) or len(row.sampled) < p.min_tokens or p.repetition_penalty != 1
            or p.presence_penalty != 0 or p.frequency_penalty != 0
            or (p.temperature > 0 and (p.top_p < 1 or p.min_p > 0)))


def process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow], eos_token_id: int | None) -> torch.Tensor:
    """`logits` ([rows, vocab]) after min_tokens, logit_bias and the penalties: what greedy rows take the
    argmax of and the others are drawn from (a copy: the raw logits stay for log-probabilities)."""
    processed = logits.float().clone()
    _mask_until_min_tokens(processed, rows, eos_token_id)
    _add_biases(processed, rows)
    if any(r.params.repetition_penalty != 1 or r.params.presence_penalty or r.params.frequency_penalty
           for r in rows):
        _penalise(processed, rows)
    return processed


def sample_processed(processed: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
    """Each row's token from its processed logits: the argmax at temperature 0, else a draw from its
    generator after temperature, min-p, top-k and top-p (`narrowed`)."""
    drawn = [row for row, r in enumerate(rows) if r.params.temperature > 0]
    tokens = torch.argmax(processed, dim=-1) if len(drawn) < len(rows) else torch.zeros(len(rows), dtype=torch.long)
    if drawn:
        scaled = narrowed(processed[drawn], [rows[row].params for row in drawn])
        tokens[drawn] = torch.tensor(draw_tokens(scaled, [rows[row].generator for row in drawn]))
    return tokens.tolist()


def narrowed(processed: torch.Tensor, params: Sequence[SamplingFields]) -> torch.Tensor:
    """Rows of processed logits (temperatures > 0) divided by their temperature, the tokens min-p, top-k and
    top-p leave out at minus infinity: what a token is drawn from."""
    scaled = processed / torch.tensor([p.temperature for p in params])[:, None]
    return _top_p(_top_k(_min_p(scaled, params), params), params)


def _vocab_pairs(pairs: list[tuple[int, int]], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, tokens) index tensors of the pairs whose token is in the vocabulary: an id beyond it (the
    routes refuse those) must not fail the engine's whole batch."""
    kept = [(row, token) for row, token in pairs if 0 <= token < vocab]
    return (torch.tensor([row for row, _ in kept], dtype=torch.long),
            torch.tensor([token for _, token in kept], dtype=torch.long))


def _mask_until_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow], eos_token_id: int | None) -> None:
    ends = () if eos_token_id is None else (eos_token_id,)
    pairs = [(index, token) for index, row in enumerate(rows) if len(row.sampled) < row.params.min_tokens
             for token in (*row.params.stop_token_ids, *ends)]
    if pairs:
        logits.index_put_(_vocab_pairs(pairs, logits.shape[-1]), torch.tensor(float("-inf")))


def _add_biases(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    biases = [(index, token, bias) for index, row in enumerate(rows) for token, bias in row.params.logit_bias
              if 0 <= token < logits.shape[-1]]
    if biases:
        index = (torch.tensor([i for i, _, _ in biases]), torch.tensor([t for _, t, _ in biases]))
        logits.index_put_(index, torch.tensor([b for _, _, b in biases], dtype=logits.dtype), accumulate=True)


def token_counts(token_lists: Sequence[Sequence[int]], vocab: int) -> torch.Tensor:
    """`[rows, vocab]`: how often each token occurs in each row's list (ids beyond the vocabulary dropped)."""
    width = max((len(tokens) for tokens in token_lists), default=0)
    padded = torch.tensor([list(tokens) + [vocab] * (width - len(tokens)) for tokens in token_lists],
                          dtype=torch.long).reshape(len(token_lists), width).clamp(0, vocab)
    counts = torch.zeros(len(token_lists), vocab + 1).scatter_add_(1, padded, torch.ones(padded.shape))
    return counts[:, :vocab]


def _penalise(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    vocab = logits.shape[-1]
    output_counts = token_counts([row.sampled for row in rows], vocab)
    in_output = output_counts > 0
    repetition = torch.tensor([row.params.repetition_penalty for row in rows])[:, None]
    if bool((repetition != 1).any()):
        seen = in_output | (token_counts([row.prompt for row in rows], vocab) > 0)
        penalties = torch.where(seen, repetition, 1.0)
        logits *= torch.where(logits > 0, 1.0 / penalties, penalties)
    logits -= torch.tensor([row.params.frequency_penalty for row in rows])[:, None] * output_counts
    logits -= torch.tensor([row.params.presence_penalty for row in rows])[:, None] * in_output


def _min_p(scaled: torch.Tensor, params: Sequence[SamplingFields]) -> torch.Tensor:
    rows = [row for row, p in enumerate(params) if p.min_p > 0]
    if not rows:
        return scaled
    probs = F.softmax(scaled[rows], dim=-1)
    floor = probs.amax(dim=-1, keepdim=True) * torch.tensor([params[row].min_p for row in rows])[:, None]
    scaled[rows] = scaled[rows].masked_fill(probs < floor, float("-inf"))
    return scaled


def _top_k(scaled: torch.Tensor, params: Sequence[SamplingFields]) -> torch.Tensor:
    vocab = scaled.shape[-1]
    rows = [row for row, p in enumerate(params) if p.top_k is not None and p.top_k < vocab]
    if not rows:
        return scaled
    ks = torch.tensor([params[row].top_k for row in rows])
    kth = torch.topk(scaled[rows], int(ks.max()), dim=-1).values.gather(1, (ks - 1)[:, None])
    scaled[rows] = scaled[rows].masked_fill(scaled[rows] < kth, float("-inf"))
    return scaled


def _top_p(scaled: torch.Tensor, params: Sequence[SamplingFields]) -> torch.Tensor:
    rows = [row for row, p in enumerate(params) if p.top_p < 1]
    if not rows:
        return scaled
    ascending, order = scaled[rows].sort(dim=-1)
    # The least likely tokens whose mass together is at most 1 - top_p go; the likeliest token always stays.
    cut = F.softmax(ascending, dim=-1).cumsum(dim=-1) <= 1 - torch.tensor([params[row].top_p for row in rows])[:, None]
    cut[:, -1] = False
    scaled[rows] = scaled[rows].scatter(1, order, ascending.masked_fill(cut, float("-inf")))
    return scaled
