"""TrainConfig.world_size_invariant: the same weights, bit for bit, at any data-parallel size."""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

from baige_ray.api.configs import TrainConfig
from baige_ray.engines.exact_gradients import ExactGradientSum, check_world_size_invariant
from baige_ray.engines.train_job import TrainJob
from baige_ray.models.corpus import CorpusConfig
from baige_ray.models.gpt import GPTConfig
from baige_ray.parallel.layout import ParallelLayout
from tests.helpers import free_port, spawn_ranks

NUM_STEPS = 4


def _job(invariant: bool = True) -> TrainJob:
    return TrainJob(
        model=GPTConfig(num_layers=2, hidden=32, num_heads=2, seq_len=16),
        train=TrainConfig(num_steps=NUM_STEPS, global_batch_size=6, micro_batch_size=1, warmup_steps=1,
                          learning_rate=1e-2, world_size_invariant=invariant),
        data=CorpusConfig(max_bytes=64 * 1024),
    )


def _train(job: TrainJob, layout: ParallelLayout, rank: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    from baige_ray.engines.factory import build_engine

    engine = build_engine(job, layout, rank)
    losses = [engine.train_step(step)["loss"] for step in range(NUM_STEPS)]
    return losses, {name: p.detach().clone() for name, p in engine.module.named_parameters()}


def _three_then_two(rank: int, port: int, results, second_port: int, invariant: bool) -> None:
    """Three replicas train from the start; then two of them, with shares of 4 and 2 micro-batches, do the same."""
    import os

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    runs = {}
    for port_used, layout in ((port, ParallelLayout(dp=3)), (second_port, ParallelLayout(dp=2, dp_microbatches=(4, 2)))):
        if rank >= layout.world_size:
            break
        os.environ["MASTER_PORT"] = str(port_used)
        dist.init_process_group("gloo", rank=rank, world_size=layout.world_size)
        runs[layout.dp] = _train(_job(invariant), layout, rank)
        dist.destroy_process_group()
    results[rank] = runs


def _replica_loss(results, dp: int) -> list[float]:
    """The step's loss as fit reduces it: the mean over the replicas of what each reports."""
    return [sum(results[rank][dp][0][step] for rank in range(dp)) / dp for step in range(NUM_STEPS)]


def test_one_two_and_three_replicas_train_the_same_bits():
    torch.set_num_threads(1)
    single_losses, single = _train(_job(), ParallelLayout(), 0)
    results = spawn_ranks(_three_then_two, 3, free_port(), True)
    for dp in (3, 2):
        weights = results[0][dp][1]
        for name, expected in single.items():
            assert torch.equal(weights[name], expected), (dp, name)
        assert _replica_loss(results, dp) == pytest.approx(single_losses, rel=1e-12)
    assert single_losses[-1] < single_losses[0]  # training moved: later steps test the gradients


def test_without_it_three_and_two_replicas_part_in_the_last_bits():
    """What the exact sum is for: DDP's averages at dp 3 and at dp 2 differ (so the test above can fail)."""
    results = spawn_ranks(_three_then_two, 3, free_port(), False)
    three, two = results[0][3][1], results[0][2][1]
    assert any(not torch.equal(three[name], two[name]) for name in three)


def test_the_exact_sum_is_the_same_however_the_shards_are_grouped():
    torch.manual_seed(0)
    shards = [torch.randn(1000) * 10.0 ** torch.randint(-6, 3, (1000,)) for _ in range(6)]
    param = torch.nn.Parameter(torch.zeros(1000))

    def summed(order: list[int]) -> torch.Tensor:
        exact = ExactGradientSum([param], total_shards=6, group=None)
        for index in order:
            param.grad = shards[index].clone()
            exact.take_shard()
        exact.reduce()
        return param.grad

    forward, backward = summed([0, 1, 2, 3, 4, 5]), summed([5, 3, 1, 0, 2, 4])
    assert torch.equal(forward, backward)
    exact = torch.stack(shards).double().sum(0)
    assert torch.equal(forward, exact.float())  # the fp64 sum of these rounds to the same fp32 values
    naive = [sum(shards[i] for i in order) for order in ([0, 1, 2, 3, 4, 5], [5, 3, 1, 0, 2, 4])]
    assert not torch.equal(naive[0], naive[1])  # fp32 addition in two orders does not agree


def test_a_tensor_no_shard_gave_a_gradient_keeps_none_and_a_non_finite_one_spoils_its_tensor():
    used, unused, broken = (torch.nn.Parameter(torch.zeros(3)) for _ in range(3))
    exact = ExactGradientSum([used, unused, broken], total_shards=2, group=None)
    for values in ([1.0, 2.0, 3.0], [0.5, 0.25, 0.125]):
        used.grad, broken.grad = torch.tensor(values), torch.tensor([1.0, float("nan"), 0.0])
        exact.take_shard()
    exact.reduce()
    assert torch.equal(used.grad, torch.tensor([1.5, 2.25, 3.125])) and unused.grad is None
    assert torch.isnan(broken.grad).all()


def test_layouts_it_does_not_cover_are_refused_naming_the_field():
    train = _job().train
    check_world_size_invariant(train, ParallelLayout(dp=4))
    for layout in (ParallelLayout(dp=2, data_parallel="fsdp2"), ParallelLayout(dp=2, tp=2),
                   ParallelLayout(dp=2, data_parallel="zero2")):
        with pytest.raises(ValueError, match="TrainConfig.world_size_invariant"):
            check_world_size_invariant(train, layout)
    with pytest.raises(ValueError, match="micro_batch_size"):
        TrainConfig(num_steps=1, world_size_invariant=True)
