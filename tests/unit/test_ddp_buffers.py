"""DDP broadcasts rank 0's buffers before every forward only where a forward changes them."""

import torch
from torch import nn

from baige_ray.engines.parallelize import _forward_changes_buffers


class Rotary(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)
        self.proj = nn.Linear(4, 4)


def test_constant_buffers_are_not_broadcast_and_running_statistics_are():
    assert not _forward_changes_buffers(Rotary())  # a transformer's rotary frequencies: left out of its state
    assert not _forward_changes_buffers(nn.Linear(4, 4))
    assert _forward_changes_buffers(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
