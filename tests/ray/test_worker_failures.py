import pytest

from baige_ray.api.configs import ScalingConfig, TrainConfig
from baige_ray.api.errors import ClusterError, WorkerError
from baige_ray.engines.train_job import TrainJob
from baige_ray.jobs.worker_group import WorkerGroup
from baige_ray.models.corpus import CorpusConfig
from baige_ray.models.gpt import GPTConfig
from baige_ray.parallel.layout import ParallelLayout

from ..helpers import FailingStepWorker

TINY_JOB = TrainJob(
    model=GPTConfig(seq_len=16, num_layers=1, num_heads=2, hidden=16),
    train=TrainConfig(num_steps=3, global_batch_size=4),
    data=CorpusConfig(max_bytes=1 << 20),
)


def test_failing_rank_is_named(local_ray):
    workers = WorkerGroup(ScalingConfig(num_workers=2), worker_cls=FailingStepWorker, timeout_s=60)
    try:
        workers.form_process_group()
        workers.call("build_engine", TINY_JOB, ParallelLayout(dp=2))
        workers.call("train_step", 0)
        with pytest.raises(WorkerError, match="injected failure") as error:
            workers.call("train_step", 1)
        assert error.value.rank == 1
    finally:
        workers.shutdown()


def test_a_failure_inside_a_call_of_several_steps_names_its_rank(local_ray):
    workers = WorkerGroup(ScalingConfig(num_workers=2), worker_cls=FailingStepWorker, timeout_s=60)
    try:
        workers.form_process_group()
        workers.call("build_engine", TINY_JOB, ParallelLayout(dp=2))
        first = workers.call("train_steps", 0, 1)
        assert [[m["step"] for m in steps] for steps in first] == [[0], [0]]
        assert all(steps[0]["rank_step_s"] > 0 for steps in first)
        with pytest.raises(WorkerError, match="injected failure") as error:
            workers.call("train_steps", 1, 2)
        assert error.value.rank == 1
    finally:
        workers.shutdown()


def test_unplaceable_group_fails_fast_with_what_is_missing(local_ray):
    scaling = ScalingConfig(num_workers=4, cpus_per_worker=3.0, placement_timeout_s=2.0)
    with pytest.raises(ClusterError, match=r"needs 4 x \{.*'CPU': 3.0\}.*available"):
        WorkerGroup(scaling)
