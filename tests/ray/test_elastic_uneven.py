"""An elastic job whose global batch does not split evenly over its workers trains like one process."""

import pytest

from baige_ray import GPTConfig, RunConfig, ScalingConfig, TrainConfig
from baige_ray.api.elastic import ElasticConfig
from baige_ray.engines.train_job import TrainJob
from baige_ray.jobs.launch import launch
from baige_ray.models.corpus import CorpusConfig

from ..helpers import reference_losses

MODEL = GPTConfig(seq_len=32, num_layers=2, num_heads=2, hidden=32)
CORPUS = CorpusConfig(max_bytes=1 << 20)
TRAIN = TrainConfig(num_steps=4, global_batch_size=10, warmup_steps=1, seed=3)  # 4 + 3 + 3 over 3 workers


def test_a_job_started_at_an_uneven_size_matches_the_single_process_losses(local_ray, tmp_path):
    run = RunConfig(name="elastic-uneven", storage_path=tmp_path, show_progress=False)
    job = launch(MODEL, train=TRAIN, scaling=ScalingConfig(num_workers=3), run=run, data=CORPUS,
                 elastic=ElasticConfig())
    result = job.wait(timeout_s=300)
    assert [m.step for m in result.metrics] == [0, 1, 2, 3]
    assert all(m.tokens == 10 * 32 for m in result.metrics)
    expected = reference_losses(TrainJob(model=MODEL, train=TRAIN, data=CORPUS))
    assert [m.loss for m in result.metrics] == pytest.approx(expected, rel=1e-5)
