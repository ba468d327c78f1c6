import pytest
import torch

from baige_ray.api.configs import TrainConfig
from baige_ray.models.corpus import CorpusConfig, stdlib_corpus
from baige_ray.models.gpt import GPTConfig
from baige_ray.runtime.train_loop import Trainer, TrainJob, learning_rate_at, sample_range

TINY = GPTConfig(seq_len=32, num_layers=2, num_heads=2, hidden=32)
CORPUS = CorpusConfig(max_bytes=1 << 20)


def job(**train_overrides) -> TrainJob:
    train = TrainConfig(**{"num_steps": 6, "global_batch_size": 8, "warmup_steps": 2, **train_overrides})
    return TrainJob(model=TINY, train=train, corpus=CORPUS)


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
    trainer = Trainer(job(num_steps=30, learning_rate=1e-2), corpus=stdlib_corpus(CORPUS))
    losses = [trainer.train_step(step)["loss"] for step in range(30)]
    assert losses[-1] < 0.8 * losses[0]


def test_gradient_accumulation_does_not_change_the_update():
    whole = Trainer(job(), corpus=stdlib_corpus(CORPUS))
    accumulated = Trainer(job(micro_batch_size=2), corpus=stdlib_corpus(CORPUS))
    for step in range(3):
        assert accumulated.train_step(step)["loss"] == pytest.approx(whole.train_step(step)["loss"], rel=1e-5)
    for a, b in zip(whole.model.parameters(), accumulated.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_model_state_is_a_detached_cpu_copy():
    trainer = Trainer(job(), corpus=stdlib_corpus(CORPUS))
    state = trainer.model_state()
    trainer.train_step(0)
    assert not torch.equal(state["lm_head.weight"], trainer.model.lm_head.weight.detach())
