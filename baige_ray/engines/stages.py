"""Carve the reference GPT into pipeline stages that keep the full model's parameter names.

A stage owns a contiguous range of blocks, plus the embeddings if it is first
and the final norm and LM head if it is last. Blocks sit in a ModuleDict keyed
by their global index, so a parameter is called `blocks.7.mlp.up.weight` on
whichever rank holds it: state moves between layouts by name.
"""

from __future__ import annotations

import torch
from torch import nn

from baige_ray.models.gpt import GPT


class GPTStage(nn.Module):
    def __init__(self, model: GPT, first_layer: int, last_layer: int, *, is_first: bool, is_last: bool):
        super().__init__()
        self.is_first, self.is_last = is_first, is_last
        if is_first:
            self.token_embedding = model.token_embedding
            self.position_embedding = model.position_embedding
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(first_layer, last_layer)})
        if is_last:
            self.final_norm = model.final_norm
            self.lm_head = model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.token_embedding(x) + self.position_embedding(positions)
        for block in self.blocks.values():
            x = block(x)
        return self.lm_head(self.final_norm(x)) if self.is_last else x


def build_stage(model: GPT, stage_index: int, layers_per_stage: tuple[int, ...]) -> GPTStage:
    first = sum(layers_per_stage[:stage_index])
    return GPTStage(
        model,
        first,
        first + layers_per_stage[stage_index],
        is_first=stage_index == 0,
        is_last=stage_index == len(layers_per_stage) - 1,
    )
