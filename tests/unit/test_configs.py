import pytest

import baige_ray as br
from baige_ray import GPTConfig, RunConfig, ScalingConfig, TrainConfig
from baige_ray.models.corpus import CorpusConfig


@pytest.mark.parametrize(
    ("factory", "field", "value"),
    [
        (lambda v: ScalingConfig(num_workers=v), "num_workers", 0),
        (lambda v: ScalingConfig(num_workers=v), "num_workers", 2.5),
        (lambda v: ScalingConfig(accelerator=v), "accelerator", "tpu"),
        (lambda v: ScalingConfig(placement_strategy=v), "placement_strategy", "RANDOM"),
        (lambda v: ScalingConfig(cpus_per_worker=v), "cpus_per_worker", -1),
        (lambda v: ScalingConfig(cpu_niceness=v), "cpu_niceness", 20),
        (lambda v: ScalingConfig(cpu_niceness=v), "cpu_niceness", -1),
        (lambda v: ScalingConfig(host_allocator=v), "host_allocator", "jemalloc"),
        (lambda v: TrainConfig(num_steps=v), "num_steps", 0),
        (lambda v: TrainConfig(num_steps=1, global_batch_size=v), "global_batch_size", True),
        (lambda v: TrainConfig(num_steps=1, learning_rate=v), "learning_rate", 0.0),
        (lambda v: TrainConfig(num_steps=1, micro_batch_size=v), "micro_batch_size", 0),
        (lambda v: TrainConfig(num_steps=1, learning_rate=1e-3, min_learning_rate=v), "min_learning_rate", 1e-2),
        (lambda v: RunConfig(name=v), "name", "a/b"),
        (lambda v: RunConfig(step_timeout_s=v), "step_timeout_s", 0),
        (lambda v: GPTConfig(hidden=v), "hidden", 130),
        (lambda v: GPTConfig(num_layers=v), "num_layers", -1),
        (lambda v: GPTConfig(dropout=v), "dropout", 1.5),
        (lambda v: CorpusConfig(max_bytes=v), "max_bytes", 10),
    ],
)
def test_bad_value_names_field_and_value(factory, field, value):
    with pytest.raises(ValueError) as error:
        factory(value)
    message = str(error.value)
    assert f".{field}=" in message
    assert repr(value) in message
    assert "expected" in message


def test_global_batch_must_split_over_workers():
    config = TrainConfig(num_steps=1, global_batch_size=30)
    assert config.per_worker_batch(3) == 10
    with pytest.raises(ValueError, match=r"global_batch_size=30 .* multiple of num_workers=4"):
        config.per_worker_batch(4)


def test_micro_batch_must_divide_per_worker_batch():
    config = TrainConfig(num_steps=1, global_batch_size=32, micro_batch_size=3)
    with pytest.raises(ValueError, match="micro_batch_size"):
        config.per_worker_batch(4)


def test_configs_are_frozen_and_keyword_only():
    with pytest.raises(TypeError):
        ScalingConfig(4)  # type: ignore[misc]
    config = ScalingConfig(num_workers=4)
    with pytest.raises(AttributeError):
        config.num_workers = 8  # type: ignore[misc]


def test_run_dir_expands_home(tmp_path):
    assert RunConfig(name="x", storage_path=tmp_path).run_dir == tmp_path / "x"
    assert "~" not in str(RunConfig(storage_path="~/results").storage_path)


def test_relative_paths_are_made_absolute_where_the_user_wrote_them(tmp_path, monkeypatch):
    """Workers and the controller run in other working directories (other machines on a cluster)."""
    monkeypatch.chdir(tmp_path)
    assert br.RunConfig(storage_path="runs").storage_path == tmp_path / "runs"
    assert br.ElasticConfig(persist_every=5, persist_path="ckpt").persist_path == tmp_path / "ckpt"
