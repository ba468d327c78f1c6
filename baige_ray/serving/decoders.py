"""One forward of a causal LM over new tokens with a KV cache: what the serving engine drives.

`forward(input_ids, position_ids, attention_mask, past)` takes `[rows, new]` tokens and their
positions, a `[rows, past_columns + new]` mask (0 for left padding) and the per-layer cache of
the rows so far (None to prefill), and returns the last position's logits per row (float32, CPU:
sampling there makes a seed give the same tokens on any device) and the cache grown by `new`
columns. `HFDecoder` hands all of it to a `transformers` model; `GPTDecoder` runs the reference
GPT's blocks with a cache (its training forward has none).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from baige_ray.serving.kv_batch import KV


class KVDecoder(Protocol):
    max_context: int  # positions the model has: prompt plus new tokens must fit

    @property
    def device(self) -> torch.device:
        """Where the model, and so the cache it returns, lives."""

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                past: KV | None) -> tuple[torch.Tensor, KV]: ...


class HFDecoder:
    def __init__(self, model: nn.Module, max_context: int):
        from baige_ray.serving.causal_lm_generation import forward_options

        self.model, self.max_context = model.eval(), max_context
        self._options = forward_options(model, use_cache=True)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                past: KV | None) -> tuple[torch.Tensor, KV]:
        from transformers import DynamicCache

        device = self.model.device
        outputs = self.model(
            input_ids=input_ids.to(device), position_ids=position_ids.to(device),
            attention_mask=attention_mask.to(device),
            past_key_values=DynamicCache(past) if past is not None else DynamicCache(), **self._options,
        )
        cache = outputs.past_key_values
        return outputs.logits[:, -1, :].float().cpu(), [(layer.keys, layer.values) for layer in cache.layers]


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
