import pytest
import torch

from baige_ray.api.configs import TrainConfig
from baige_ray.engines.factory import build_engine
from baige_ray.engines.train_job import TrainJob, learning_rate_at, sample_range
from baige_ray.models.corpus import CorpusConfig
from baige_ray.models.gpt import GPT, GPTConfig
from baige_ray.parallel.layout import ParallelLayout

TINY = GPTConfig(seq_len=32, num_layers=2, num_heads=2, hidden=32)
CORPUS = CorpusConfig(max_bytes=1 << 20)


def job(**train_overrides) -> TrainJob:
    train = TrainConfig(**{"num_steps": 6, "global_batch_size": 8, "warmup_steps": 2, **train_overrides})
    return TrainJob(model=TINY, train=train, data=CORPUS)


def test_learning_rate_warms_up_then_decays_to_minimum():
    config = TrainConfig(num_steps=100, learning_rate=1e-2, min_learning_rate=1e-3, warmup_steps=10)
    rates = [learning_rate_at(step, config) for step in range(100)]
    assert rates[0] == pytest.approx(1e-3)
    assert rates[9] == pytest.approx(1e-2)
    assert all(a >= b for a, b in zip(rates[10:], rates[11:]))
    assert learning_rate_at(100, config) == pytest.approx(1e-3)


def test_sample_ranges_partition_each_step():
    ranges = [sample_range(3, rank, 4, 32) for rank in range(4)]
    assert [i for r in ranges for i in r] == list(range(96, 128))


def test_loss_falls_on_real_text():
    trainer = build_engine(job(num_steps=30, learning_rate=1e-2), ParallelLayout())
    losses = [trainer.train_step(step)["loss"] for step in range(30)]
    assert losses[-1] < 0.8 * losses[0]


def test_gradient_accumulation_does_not_change_the_update():
    whole = build_engine(job(), ParallelLayout())
    accumulated = build_engine(job(micro_batch_size=2), ParallelLayout())
    for step in range(3):
        assert accumulated.train_step(step)["loss"] == pytest.approx(whole.train_step(step)["loss"], rel=1e-5)
    for a, b in zip(whole.parameters, accumulated.parameters):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_exported_state_is_a_detached_copy_under_canonical_names():
    engine = build_engine(job(), ParallelLayout())
    engine.train_step(0)
    state = engine.export_state()
    assert set(state["model"]) == {name for name, _ in GPT(TINY).named_parameters()}
    assert set(state["optimizer"]["lm_head.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    engine.train_step(1)
    assert not torch.equal(state["model"]["lm_head.weight"], engine.module[0].lm_head.weight.detach())


def test_state_round_trip_continues_identically():
    straight = build_engine(job(), ParallelLayout())
    losses = [straight.train_step(step)["loss"] for step in range(4)]
    first = build_engine(job(), ParallelLayout())
    first.train_step(0), first.train_step(1)
    resumed = build_engine(job(), ParallelLayout())
    resumed.import_state(first.export_state())
    assert [resumed.train_step(step)["loss"] for step in (2, 3)] == pytest.approx(losses[2:], rel=1e-6)
