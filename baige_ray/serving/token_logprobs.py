"""Log-probabilities as vLLM reports them by default (`logprobs_mode="raw_logprobs"`, vLLM 0.32): the
log-softmax, in fp32, of the model's own logits, before penalties, biases, temperature or any narrowing.

A position's `TokenLogprobs` are (token id, log-probability) pairs: the token actually there first
(the one sampled, or the prompt's own), then the `k` likeliest in rank order, each token once. That is
the order of vLLM's per-position dicts, from which the OpenAI shapes are cut (openai_logprobs.py). A
prompt's first token has none: nothing comes before it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

TokenLogprobs = tuple[tuple[int, float], ...]
PromptLogprobs = tuple[TokenLogprobs | None, ...]


def ranked(log_probs: torch.Tensor, tokens: Sequence[int], ks: Sequence[int]) -> list[TokenLogprobs]:
    """Row i of `log_probs` ([rows, vocab]): tokens[i]'s log-probability, then the ks[i] likeliest (-1: the
    whole vocabulary)."""
    vocab = log_probs.shape[-1]
    widths = [vocab if k == -1 else min(k, vocab) for k in ks]
    chosen = log_probs.gather(-1, torch.tensor(tokens, dtype=torch.long)[:, None])[:, 0].tolist()
    widest = max(widths, default=0)
    top = torch.topk(log_probs, widest, dim=-1) if widest else None
    entries = []
    for row, (token, width) in enumerate(zip(tokens, widths)):
        best = [] if top is None else zip(top.indices[row, :width].tolist(), top.values[row, :width].tolist())
        entries.append(((token, chosen[row]), *((t, value) for t, value in best if t != token)))
    return entries


def prompt_logprobs(logits: torch.Tensor, prompt: Sequence[int], k: int) -> PromptLogprobs:
    """Each prompt token's entry from `logits` ([len(prompt), vocab], position i's predicting token i + 1);
    None for the first."""
    if len(prompt) < 2:
        return (None,) * len(prompt)
    log_probs = F.log_softmax(logits[:-1].float(), dim=-1)
    return (None, *ranked(log_probs, list(prompt[1:]), [k] * (len(prompt) - 1)))
