"""A Hugging Face causal LM served: one forward over new tokens with transformers' own cache."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from baige_ray.models.generation import KV


def forward_options(model: Any, use_cache: bool) -> dict[str, Any]:
    options: dict[str, Any] = {"use_cache": use_cache}
    # Only the last position is sampled; without this the prefill materialises
    # prompt_length x vocab_size logits per row.
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        options["logits_to_keep"] = 1
    return options


class HFDecoder:
    def __init__(self, model: nn.Module, max_context: int):
        self.model, self.max_context = model.eval(), max_context
        self._options = forward_options(model, use_cache=True)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                past: KV | None, *, all_positions: bool = False) -> tuple[torch.Tensor, KV]:
        from transformers import DynamicCache

        device = self.model.device
        options = {**self._options, "logits_to_keep": 0} if all_positions and "logits_to_keep" in self._options \
            else self._options
        outputs = self.model(
            input_ids=input_ids.to(device), position_ids=position_ids.to(device),
            attention_mask=attention_mask.to(device),
            past_key_values=DynamicCache(past) if past is not None else DynamicCache(), **options,
        )
        cache = outputs.past_key_values
        logits = outputs.logits if all_positions else outputs.logits[:, -1, :]
        return logits.float().cpu(), [(layer.keys, layer.values) for layer in cache.layers]
