"""Batched sampling from the byte-level GPT for a batch of independent requests.

The reference GPT has no padding mask, so prompts of different lengths cannot share a forward
pass without changing each other's results. A batch is therefore split into groups of equal
prompt length; each group runs one forward per new token for all its rows, and each row samples
with its own temperature and its own generator, so a request's text does not depend on what it
was batched with (up to floating-point summation order).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from baige_ray.models.gpt import GPT
from baige_ray.serving.requests import GenerateRequest

TOP_K = 40


def encode_prompt(prompt: str, seq_len: int) -> list[int]:
    """UTF-8 bytes of the prompt; only the last seq_len fit the model's window."""
    return list(prompt.encode("utf-8"))[-seq_len:]


def decode_tokens(tokens: Sequence[int]) -> str:
    return bytes(tokens).decode("utf-8", errors="replace")


def seeded_generator(seed: int | None) -> torch.Generator:
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def sample_token(logits: torch.Tensor, temperature: float, generator: torch.Generator,
                 top_k: int | None = TOP_K) -> int:
    """Argmax at temperature 0; otherwise a draw from the top-k of softmax(logits / temperature)."""
    if temperature == 0:
        return int(torch.argmax(logits))
    scaled = logits / temperature
    if top_k is not None and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return int(torch.multinomial(F.softmax(scaled, dim=-1), 1, generator=generator))


@torch.no_grad()
def _generate_group(model: GPT, prompts: list[list[int]], requests: list[GenerateRequest]) -> list[list[int]]:
    """New tokens for rows whose prompts have the same length."""
    tokens = torch.tensor(prompts, dtype=torch.long)
    generators = [seeded_generator(request.seed) for request in requests]
    longest = max(request.max_new_tokens for request in requests)
    new_tokens: list[list[int]] = [[] for _ in requests]
    for position in range(longest):
        window = tokens[:, -model.config.seq_len :]
        logits = model(window)[:, -1, :].float()
        next_column = []
        for row, request in enumerate(requests):
            token = sample_token(logits[row], request.temperature, generators[row])
            if position < request.max_new_tokens:
                new_tokens[row].append(token)
            next_column.append(token)
        tokens = torch.cat([tokens, torch.tensor(next_column, dtype=torch.long)[:, None]], dim=1)
    return new_tokens


def generate_batch(model: GPT, requests: Sequence[GenerateRequest]) -> list[list[int]]:
    """New tokens for each request, in request order."""
    return generate_from_tokens(model, [encode_prompt(r.prompt, model.config.seq_len) for r in requests], requests)


def generate_from_tokens(model: GPT, prompts: Sequence[list[int]], requests: Sequence[GenerateRequest]) -> list[list[int]]:
    """New tokens for prompts given as byte tokens (`requests` give the sampling settings; their prompts are unused)."""
    model.eval()
    groups: dict[int, list[int]] = defaultdict(list)
    for index, prompt in enumerate(prompts):
        groups[len(prompt)].append(index)
    results: list[list[int]] = [[] for _ in requests]
    for indices in groups.values():
        outputs = _generate_group(model, [prompts[i] for i in indices], [requests[i] for i in indices])
        for index, output in zip(indices, outputs):
            results[index] = output
    return results
