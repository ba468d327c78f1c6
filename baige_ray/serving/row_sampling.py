"""The next token of every request in a batch, and the log-probabilities each asked for, from the rows'
last logits: what the built-in engine's prefill and decode steps, the prefill engine and the RL batch
generator all sample with.

A batch whose rows all sample plainly (temperature and top-k only: models/generation.py) takes the
plain path, unchanged: the same cost and the same tokens for a seed as before the other fields
existed. Any row asking for more sends the batch through models/logits_processing.py, vLLM's order,
still in one pass over all rows. Log-probabilities are raw (serving/token_logprobs.py): the sampled
token's alone for `log_probs` (an RL policy's), the likeliest `num_logprobs` for OpenAI's `logprobs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from baige_ray.models.generation import sample_token, sample_tokens
from baige_ray.models.logits_processing import SamplingRow, needs_processing, process_logits, sample_processed
from baige_ray.serving.token_logprobs import TokenLogprobs, ranked


@dataclass(frozen=True)
class SampledToken:
    token: int
    log_prob: float | None = None  # the request asked for it (`log_probs`)
    logprobs: TokenLogprobs | None = None  # the request asked for the likeliest (`num_logprobs`)


def sample_rows(logits: torch.Tensor, rows: Sequence[SamplingRow], eos_token_id: int | None) -> list[SampledToken]:
    """Row i's token from logits[i] ([rows, vocab]) with rows[i]'s generator, and its log-probabilities."""
    return _with_log_probs(logits, rows, _tokens(logits, rows, eos_token_id))


def _tokens(logits: torch.Tensor, rows: Sequence[SamplingRow], eos_token_id: int | None) -> list[int]:
    if any(needs_processing(row) for row in rows):
        return sample_processed(process_logits(logits, rows, eos_token_id), rows)
    first = rows[0].params
    if any((row.params.temperature, row.params.top_k) != (first.temperature, first.top_k) for row in rows):
        return [sample_token(logits[index], row.params.temperature, row.generator, row.params.top_k)
                for index, row in enumerate(rows)]
    return sample_tokens(logits, first.temperature, [row.generator for row in rows], first.top_k)


def _with_log_probs(logits: torch.Tensor, rows: Sequence[SamplingRow], tokens: list[int]) -> list[SampledToken]:
    raw = [row.params.log_probs for row in rows]
    top = [row.params.num_logprobs for row in rows]
    if not any(raw) and all(k is None for k in top):
        return [SampledToken(token) for token in tokens]
    log_probs = F.log_softmax(logits.float(), dim=-1)
    chosen = log_probs.gather(-1, torch.tensor(tokens, dtype=torch.long)[:, None])[:, 0].tolist()
    wanting = [index for index, k in enumerate(top) if k is not None]
    entries = dict(zip(wanting, ranked(log_probs[wanting], [tokens[i] for i in wanting],
                                       [top[i] for i in wanting]))) if wanting else {}
    return [SampledToken(token, chosen[index] if raw[index] else None, entries.get(index))
            for index, token in enumerate(tokens)]
