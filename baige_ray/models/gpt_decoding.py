"""The reference GPT served: its blocks run with a KV cache (its training forward has none), and its
tokens are UTF-8 bytes. `generate_batch` samples from it without a cache, one group of equal prompt
lengths at a time (it has no padding mask): the reference the serving engine is checked against; each
row samples with its own temperature and generator, so a request's text does not depend on what it was
batched with (up to floating-point summation order). Requests are anything with max_new_tokens,
temperature and seed (serving's GenerateRequest)."""

from __future__ import annotations

import codecs
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from baige_ray.models.generation import KV, IncrementalDecoder, plain_chat_prompt, sample_token, seeded_generator
from baige_ray.models.gpt import GPT


class GPTDecoder:
    """The reference GPT (models/gpt.py) with a KV cache; its learned positions bound the context."""

    def __init__(self, model: nn.Module):
        self.model = model.eval()
        self.max_context = model.config.seq_len

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                past: KV | None, *, all_positions: bool = False) -> tuple[torch.Tensor, KV]:
        model = self.model
        device = self.device
        input_ids, position_ids, attention_mask = input_ids.to(device), position_ids.to(device), attention_mask.to(device)
        rows, new = input_ids.shape
        columns = attention_mask.shape[1]
        # Query i (at column columns - new + i) sees the filled columns up to its own.
        causal = torch.arange(columns, device=device)[None, :] <= (columns - new + torch.arange(new, device=device))[:, None]
        visible = causal[None, None] & attention_mask.bool()[:, None, None, :]
        x = model.token_embedding(input_ids) + model.position_embedding(position_ids)
        layers: KV = []
        for index, block in enumerate(model.blocks):
            attention = block.attn
            h = block.attn_norm(x)
            q, k, v = (proj(h).view(rows, new, -1, attention.head_dim).transpose(1, 2)
                       for proj in (attention.q_proj, attention.k_proj, attention.v_proj))
            if past is not None:
                k, v = torch.cat([past[index][0], k], dim=2), torch.cat([past[index][1], v], dim=2)
            layers.append((k, v))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
            x = x + attention.o_proj(y.transpose(1, 2).reshape(rows, new, -1))
            x = x + block.mlp(block.mlp_norm(x))
        return model.lm_head(model.final_norm(x if all_positions else x[:, -1])).float().cpu(), layers


class ByteCodec:
    """The reference GPT's: tokens are the prompt's UTF-8 bytes; no end-of-text token."""

    eos_token_id = None

    def encode(self, prompt: str) -> list[int]:
        return list(prompt.encode("utf-8"))

    def decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return _ByteDecoder()  # bytes only: no special token to skip

    def chat_tokens(self, messages: tuple[tuple[str, str], ...], tools: tuple[dict, ...] | None = None) -> list[int]:
        return self.encode(plain_chat_prompt(messages))  # no template: nothing writes tools in

    def token_text(self, token: int) -> str:
        return bytes([token]).decode("utf-8", errors="replace")

    def tokens_text(self, tokens: list[int]) -> str:
        return bytes(tokens).decode("utf-8", errors="replace")


class _ByteDecoder:
    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self._utf8.decode(bytes([token]))

    def flush(self) -> str:
        """Nothing for bytes that end mid-character: the character was never finished (vLLM drops it too)."""
        partial, _ = self._utf8.getstate()
        self._utf8.reset()
        return "" if partial else self._utf8.decode(b"", final=True)


def encode_prompt(prompt: str, seq_len: int) -> list[int]:
    """UTF-8 bytes of the prompt; only the last seq_len fit the model's window."""
    return list(prompt.encode("utf-8"))[-seq_len:]


def decode_tokens(tokens: Sequence[int]) -> str:
    """The text of byte tokens as served: an invalid byte is U+FFFD, a character left unfinished at the end is
    dropped (vLLM's rule)."""
    decoder = _ByteDecoder()
    return "".join(decoder.push(token) for token in tokens) + decoder.flush()


@torch.no_grad()
def _generate_group(model: GPT, prompts: list[list[int]], requests: list[Any]) -> list[list[int]]:
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


def generate_batch(model: GPT, requests: Sequence[Any]) -> list[list[int]]:
    """New tokens for each request, in request order."""
    return generate_from_tokens(model, [encode_prompt(r.prompt, model.config.seq_len) for r in requests], requests)


def generate_from_tokens(model: GPT, prompts: Sequence[list[int]], requests: Sequence[Any]) -> list[list[int]]:
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
