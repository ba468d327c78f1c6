"""Data parallel over chips of different speeds: uneven micro-batch shares train like one process."""

import pytest
import torch
import torch.distributed as dist

from baige_ray.api.configs import TrainConfig
from baige_ray.engines.train_job import TrainJob, replica_sample_range, sample_range
from baige_ray.models.corpus import CorpusConfig
from baige_ray.models.gpt import GPTConfig
from baige_ray.parallel.layout import ParallelLayout
from tests.helpers import spawn_ranks

NUM_STEPS = 3


def _job() -> TrainJob:
    return TrainJob(
        model=GPTConfig(num_layers=2, hidden=32, num_heads=2, seq_len=16),
        train=TrainConfig(num_steps=NUM_STEPS, global_batch_size=6, micro_batch_size=1, warmup_steps=1, log_every=1),
        data=CorpusConfig(max_bytes=64 * 1024),
    )


def _unevenly_split_job() -> TrainJob:
    """A global batch of 5 over two replicas, no micro-batches: shares of 3 and 2 sequences."""
    return TrainJob(
        model=GPTConfig(num_layers=2, hidden=32, num_heads=2, seq_len=16),
        train=TrainConfig(num_steps=NUM_STEPS, global_batch_size=5, warmup_steps=1, log_every=1),
        data=CorpusConfig(max_bytes=64 * 1024),
    )


def _train_uneven_replicas(rank: int, port: int, results, split: str = "speeds") -> None:
    import os

    from baige_ray.engines.factory import build_engine

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    job, shares = (_job(), (4, 2)) if split == "speeds" else (_unevenly_split_job(), (3, 2))
    engine = build_engine(job, ParallelLayout(dp=2, dp_microbatches=shares), rank)
    steps = [engine.train_step(step) for step in range(NUM_STEPS)]
    results[rank] = ([s["loss"] for s in steps], [s["tokens"] for s in steps], engine.per_replica_batch)
    dist.destroy_process_group()


def test_uneven_shares_give_the_single_process_losses_step_by_step():
    from tests.helpers import reference_losses

    results = spawn_ranks(_train_uneven_replicas, 2)
    assert results[0][2] == 4 and results[1][2] == 2  # sequences per replica follow the shares
    assert [a + b for a, b in zip(results[0][1], results[1][1])] == [6 * 16] * NUM_STEPS
    # The step's loss is the mean over replicas of their weighted partial sums, as fit reduces it.
    losses = [(a + b) / 2 for a, b in zip(results[0][0], results[1][0])]
    expected = reference_losses(_job())
    assert losses == pytest.approx(expected, rel=1e-3)
    assert losses[-1] != pytest.approx(losses[0], rel=1e-3)  # training moved, so later steps test the gradients


def test_a_batch_that_does_not_split_evenly_trains_like_one_process():
    from tests.helpers import reference_losses

    results = spawn_ranks(_train_uneven_replicas, 2, "uneven")
    assert (results[0][2], results[1][2]) == (3, 2)  # each replica trains its share in one pass
    losses = [(a + b) / 2 for a, b in zip(results[0][0], results[1][0])]
    assert losses == pytest.approx(reference_losses(_unevenly_split_job()), rel=1e-5)


def test_replica_ranges_are_consecutive_and_cover_the_global_batch():
    assert [replica_sample_range(2, r, (4, 2)) for r in (0, 1)] == [range(12, 16), range(16, 18)]
    for rank in range(4):
        assert replica_sample_range(3, rank, (8,) * 4) == sample_range(3, rank, 4, 32)


def test_replica_batches_follow_the_shares_and_must_add_up():
    train = TrainConfig(num_steps=1, global_batch_size=12, micro_batch_size=2)
    assert ParallelLayout(dp=2, dp_microbatches=(4, 2)).replica_batches(train) == (8, 4)
    assert ParallelLayout(dp=3).replica_batches(train) == (4, 4, 4)
    with pytest.raises(ValueError, match="dp_microbatches"):
        ParallelLayout(dp=2, dp_microbatches=(4, 1)).replica_batches(train)
    # Without a micro-batch size the shares count sequences.
    unsplit = TrainConfig(num_steps=1, global_batch_size=12)
    assert ParallelLayout(dp=2, dp_microbatches=(7, 5)).replica_batches(unsplit) == (7, 5)
    with pytest.raises(ValueError, match="dp_microbatches"):
        ParallelLayout(dp=2, dp_microbatches=(8, 5)).replica_batches(unsplit)


@pytest.mark.parametrize("fields", [
    dict(dp=2, dp_microbatches=(1,)),
    dict(dp=2, dp_microbatches=(3, 0)),
    dict(dp=2, pp=2, dp_microbatches=(3, 1)),
    dict(dp=2, tp=2, dp_microbatches=(3, 1)),
    dict(dp=2, data_parallel="fsdp2", dp_microbatches=(3, 1)),
])
def test_layout_rejects_bad_shares_naming_the_field(fields):
    with pytest.raises(ValueError, match="dp_microbatches"):
        ParallelLayout(**fields)
