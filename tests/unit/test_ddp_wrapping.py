"""apply_ddp: buckets settled at construction, or the unused-parameter search where it is needed."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from baige_ray.engines.parallelize import apply_ddp


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


class TwoLayers(nn.Module):
    def __init__(self, use_second: bool = True):
        super().__init__()
        self.first, self.second, self.use_second = nn.Linear(4, 4), nn.Linear(4, 4), use_second

    def forward(self, x):
        hidden = self.first(x)
        return self.second(hidden) if self.use_second else hidden


def zero_loss(module: nn.Module) -> torch.Tensor:
    return module(torch.ones(1, 4)).sum() * 0.0


def test_a_zero_loss_settles_the_buckets_and_leaves_no_gradient(one_rank_group):
    model = apply_ddp(TwoLayers(), one_rank_group, on_accelerator=False, zero_loss=zero_loss)
    assert not model.find_unused_parameters
    assert all(p.grad is None for p in model.parameters())
    model(torch.ones(2, 4)).sum().backward()  # the first real step runs in the settled layout
    assert model._has_rebuilt_buckets


def test_an_unused_parameter_or_no_zero_loss_keeps_the_unused_parameter_search(one_rank_group):
    assert apply_ddp(TwoLayers(use_second=False), one_rank_group, False, zero_loss).find_unused_parameters
    assert apply_ddp(TwoLayers(), one_rank_group, False).find_unused_parameters
