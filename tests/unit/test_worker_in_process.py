"""The worker and its process-group membership, in this process, without Ray."""

import gc
import os
import weakref

import pytest
import torch.distributed as dist

from baige_ray.actors.worker import ElasticWorkerActor, StepFailed, WorkerActor
from baige_ray.api.configs import TrainConfig
from baige_ray.engines.train_job import TrainJob
from baige_ray.models.corpus import CorpusConfig
from baige_ray.models.gpt import GPTConfig
from baige_ray.parallel.distributed import GroupMembership, StoreAddress
from baige_ray.parallel.layout import ParallelLayout


@pytest.fixture
def worker():
    actor = WorkerActor()
    yield actor
    actor.leave_group()


def _join(worker: WorkerActor, generation: int) -> None:
    store = worker.host_store("127.0.0.1")
    worker.join_group(GroupMembership(store=store, rank=0, world_size=1, generation=generation))


def test_device_info_outside_ray(worker):
    info = worker.device_info()
    assert info.pid == os.getpid()
    assert info.device_kind == "cpu" and info.ray_resource == "CPU"
    assert info.memory_bytes > 0 and not info.simulated


def test_join_leave_and_join_next_generation(worker):
    _join(worker, 0)
    assert worker.all_reduce([1.5, 2.0]) == [1.5, 2.0]
    worker.leave_group()
    assert not dist.is_initialized()
    _join(worker, 1)
    assert dist.get_world_size() == 1
    assert worker.group.membership.generation == 1


def tiny_gpt_job() -> TrainJob:
    return TrainJob(
        model=GPTConfig(seq_len=16, num_layers=1, num_heads=2, hidden=16),
        train=TrainConfig(num_steps=3, global_batch_size=4),
        data=CorpusConfig(max_bytes=1 << 20),
    )


def test_engine_needs_a_group_and_runs_steps(worker):
    job = tiny_gpt_job()
    with pytest.raises(RuntimeError, match="not joined"):
        worker.build_engine(job, ParallelLayout())
    _join(worker, 0)
    with pytest.raises(ValueError, match="needs 2 ranks"):
        worker.build_engine(job, ParallelLayout(dp=2))
    report = worker.build_engine(job, ParallelLayout())
    assert report["num_parameters"] > 0
    metrics = worker.train_step(0)
    assert metrics["tokens"] == 4 * 16
    steps = worker.train_steps(1, 2)
    assert [m["step"] for m in steps] == [1, 2] and all(m["rank_step_s"] > 0 for m in steps)


def test_an_elastic_worker_reports_group_totals_and_keeps_a_snapshot():
    worker = ElasticWorkerActor()
    try:
        _join(worker, 0)
        worker.build_engine(tiny_gpt_job(), ParallelLayout())
        elastic = worker.elastic_step(0)  # the step's totals over the group come with each rank's own metrics
        assert elastic["group_loss"] == pytest.approx(elastic["loss"]) and elastic["group_tokens"] == 4 * 16
        assert worker.snapshot_step() == 0 and worker.heartbeat()["step"] == 0
    finally:
        worker.leave_group()


def test_a_failed_step_lets_its_engine_go_while_its_error_is_still_held():
    """Ray keeps a failed call's error until it is sent; the engine (weights, activations) must not be
    kept with it, or the next generation's engine is built beside the old one."""
    worker = ElasticWorkerActor()
    try:
        _join(worker, 0)
        worker.build_engine(tiny_gpt_job(), ParallelLayout())
        worker.elastic_step(0)
        old = weakref.ref(worker.engine)

        def peer_died(step):
            raise RuntimeError("connection closed by peer")

        worker.engine.train_step = peer_died
        with pytest.raises(StepFailed, match="connection closed by peer") as failed:
            worker.elastic_step(1)
        _join(worker, 1)  # the next generation drops the engine
        gc.collect()
        assert old() is None and "Traceback" in str(failed.value)
    finally:
        worker.leave_group()


def test_fit_workers_are_single_threaded_actors():
    """Ray runs a class with concurrency-group methods as a threaded actor (see ELASTIC_WORKER_THREADS)."""
    grouped = [name for name in dir(WorkerActor) if hasattr(getattr(WorkerActor, name), "__ray_concurrency_group__")]
    assert grouped == []
    assert hasattr(ElasticWorkerActor.heartbeat, "__ray_concurrency_group__")


def test_membership_validates_rank():
    with pytest.raises(ValueError, match="rank=3"):
        GroupMembership(store=StoreAddress("127.0.0.1", 1), rank=3, world_size=2, generation=0)
