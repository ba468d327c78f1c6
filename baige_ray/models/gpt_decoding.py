"""The reference GPT served: its blocks run with a KV cache (its training forward has none), and its
tokens are UTF-8 bytes."""

from __future__ import annotations

import codecs

import torch
import torch.nn.functional as F
from torch import nn

from baige_ray.models.generation import KV, IncrementalDecoder, plain_chat_prompt


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
                past: KV | None) -> tuple[torch.Tensor, KV]:
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
        return model.lm_head(model.final_norm(x[:, -1])).float().cpu(), layers


class ByteCodec:
    """The reference GPT's: tokens are the prompt's UTF-8 bytes; no end-of-text token."""

    eos_token_id = None

    def encode(self, prompt: str) -> list[int]:
        return list(prompt.encode("utf-8"))

    def decoder(self) -> IncrementalDecoder:
        return _ByteDecoder()

    def chat_tokens(self, messages: tuple[tuple[str, str], ...]) -> list[int]:
        return self.encode(plain_chat_prompt(messages))


class _ByteDecoder:
    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self._utf8.decode(bytes([token]))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
