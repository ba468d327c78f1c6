import pytest

from baige_ray import GPTConfig, RunConfig, ScalingConfig, TrainConfig, fit, load_model
from baige_ray.engines.train_job import TrainJob
from baige_ray.models.corpus import CorpusConfig
from baige_ray.parallel.layout import ParallelLayout

from ..helpers import reference_losses

MODEL = GPTConfig(seq_len=32, num_layers=2, num_heads=2, hidden=32)
CORPUS = CorpusConfig(max_bytes=1 << 20)
TRAIN = TrainConfig(num_steps=4, global_batch_size=8, micro_batch_size=2, warmup_steps=1, seed=3)


@pytest.fixture(scope="module")
def result(local_ray, tmp_path_factory):
    run = RunConfig(name="ddp2", storage_path=tmp_path_factory.mktemp("runs"), show_progress=False)
    return fit(MODEL, train=TRAIN, scaling=ScalingConfig(num_workers=2), run=run, data=CORPUS)


def test_ddp_matches_single_process_step_by_step(result):
    assert result.losses == pytest.approx(reference_losses(TrainJob(model=MODEL, train=TRAIN, data=CORPUS)), rel=1e-5)


def test_result_reports_workers_and_throughput(result):
    assert result.num_workers == 2
    assert [m.step for m in result.metrics] == [0, 1, 2, 3]
    assert all(m.tokens == 8 * 32 and m.tokens_per_s > 0 for m in result.metrics)


def test_final_checkpoint_loads_and_generates(result):
    model = load_model(result.checkpoint_path)
    assert model.config == MODEL


def test_uneven_batch_fails_before_any_actor_starts(local_ray):
    with pytest.raises(ValueError, match="global_batch_size=8 .* num_workers=3"):
        fit(MODEL, train=TRAIN, scaling=ScalingConfig(num_workers=3), data=CORPUS)


def test_uneven_data_parallel_shares_match_single_process_step_by_step(local_ray, tmp_path):
    # A full-speed and a half-speed chip, the faster training 3 of the 4 micro-batches.
    run = RunConfig(name="ddp-uneven", storage_path=tmp_path, show_progress=False)
    result = fit(
        MODEL, train=TRAIN, layout=ParallelLayout(dp=2, dp_microbatches=(3, 1)), emulated_speeds=[1.0, 0.5],
        scaling=ScalingConfig(num_workers=2), run=run, data=CORPUS,
    )
    assert result.losses == pytest.approx(reference_losses(TrainJob(model=MODEL, train=TRAIN, data=CORPUS)), rel=1e-5)
    assert all(m.tokens == 8 * 32 for m in result.metrics)
