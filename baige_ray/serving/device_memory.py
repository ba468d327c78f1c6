"""Device memory an idle engine gives back while something else uses its device, and takes again.

Reinforcement learning places rollout replicas and training workers on the same devices, taking turns
(`GRPOTrainer` with placement "colocated"): while the policy trains, each replica's engine frees the
keys and values of its running batch and, on an accelerator, moves its model's weights to host memory;
it moves them back before it decodes again. On the host nothing moves: the weights stay where they are.
"""

from __future__ import annotations

import torch
from torch import nn


class ModelOffload:
    """A model's weights moved to host memory from `device`, until `restore`."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.model, self.device = model, torch.device(device)
        self.moved_bytes = 0
        if self.device.type != "cpu":
            self.moved_bytes = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
            model.to("cpu")
            _empty_cache(self.device)

    def restore(self) -> None:
        if self.device.type != "cpu":
            self.model.to(self.device)


def _empty_cache(device: torch.device) -> None:
    module = getattr(torch, device.type, None)  # torch.cuda, torch.xpu: their caching allocators keep freed blocks
    if module is not None and hasattr(module, "empty_cache"):
        module.empty_cache()
