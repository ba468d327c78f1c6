"""A persisted checkpoint continues training as if it had never stopped, also under another micro-batch setting."""

import dataclasses

import pytest
import torch

from baige_ray.api.configs import TrainConfig
from baige_ray.checkpoint.persister import AsyncPersister
from baige_ray.checkpoint.store import load_latest_good
from baige_ray.elastic.snapshot import HostSnapshotter
from baige_ray.engines.factory import build_engine
from baige_ray.engines.train_job import TrainJob
from baige_ray.models.gpt import GPTConfig
from baige_ray.parallel.layout import ParallelLayout

NUM_STEPS = 6
STOP_AFTER = 2
JOB = TrainJob(
    model=GPTConfig(seq_len=16, num_layers=2, num_heads=2, hidden=32),
    train=TrainConfig(num_steps=NUM_STEPS, global_batch_size=4, warmup_steps=2, seed=3),
)


def train(engine, steps) -> list[float]:
    return [engine.train_step(step)["loss"] for step in steps]


def final_model(engine) -> dict[str, torch.Tensor]:
    return engine.export_state()["model"]


@pytest.fixture(scope="module")
def uninterrupted():
    engine = build_engine(JOB, ParallelLayout())
    losses = train(engine, range(NUM_STEPS))
    return losses, final_model(engine)


def persist_after_stop(root, use_snapshotter: bool) -> None:
    """Train to STOP_AFTER and persist the state after that step, from a snapshot or a direct export."""
    engine = build_engine(JOB, ParallelLayout())
    snapshotter = HostSnapshotter(engine) if use_snapshotter else None
    for step in range(STOP_AFTER + 1):
        engine.train_step(step)
        if snapshotter is not None:
            snapshotter.after_step(step)
    step, state = snapshotter.latest() if snapshotter else (STOP_AFTER, engine.export_state())
    meta = {"layout": engine.layout.describe(), "model_config": dataclasses.asdict(JOB.model)}
    with AsyncPersister(root) as persister:
        persister.submit(step, state, meta)
    assert persister.errors == [] and persister.last_persisted_step == STOP_AFTER


def resume(root, job: TrainJob):
    step, state, meta = load_latest_good(root)
    assert step == STOP_AFTER and meta["model_config"] == dataclasses.asdict(JOB.model)
    engine = build_engine(job, ParallelLayout())
    engine.import_state(state)
    return engine, train(engine, range(step + 1, NUM_STEPS))


@pytest.mark.parametrize("use_snapshotter", [False, True], ids=["export", "snapshot"])
def test_same_setting_resumes_bitwise(tmp_path, uninterrupted, use_snapshotter):
    losses, model = uninterrupted
    persist_after_stop(tmp_path, use_snapshotter)
    engine, resumed = resume(tmp_path, JOB)
    assert resumed == losses[STOP_AFTER + 1:]
    for name, tensor in final_model(engine).items():
        assert torch.equal(tensor, model[name]), name


def test_other_micro_batch_setting_resumes_within_tolerance(tmp_path, uninterrupted):
    losses, model = uninterrupted
    persist_after_stop(tmp_path, use_snapshotter=False)
    accumulating = dataclasses.replace(JOB, train=dataclasses.replace(JOB.train, micro_batch_size=1))
    engine, resumed = resume(tmp_path, accumulating)
    assert resumed == pytest.approx(losses[STOP_AFTER + 1:], rel=1e-6)
    for name, tensor in final_model(engine).items():
        torch.testing.assert_close(tensor, model[name], rtol=1e-5, atol=1e-6)
