"""The elastic controller's pure parts: states, config, faults, sizing, snapshots."""

from __future__ import annotations

import pytest
import torch

from baige_ray.api.configs import TrainConfig
from baige_ray.api.elastic import ElasticConfig
from baige_ray.elastic.faults import FaultKind, FaultPlan
from baige_ray.elastic.machine import Phase, StateMachine
from baige_ray.elastic.sizing import layout_for, valid_sizes
from baige_ray.elastic.snapshot import HostSnapshotter
from baige_ray.parallel.packed_tensors import PackedTensors
from baige_ray.engines.factory import build_engine
from baige_ray.engines.train_job import TrainJob
from baige_ray.models.mlp import MLPConfig
from baige_ray.parallel.layout import ParallelLayout


def test_state_machine_allows_the_recovery_cycle_and_refuses_shortcuts():
    machine = StateMachine()
    for phase in (Phase.STARTING, Phase.RUNNING, Phase.RECOVERING, Phase.RUNNING, Phase.RESIZING, Phase.RUNNING,
                  Phase.FINISHED):
        machine.advance(phase)
    assert machine.done
    assert [t.target for t in machine.history][-1] is Phase.FINISHED
    with pytest.raises(RuntimeError, match="cannot go from planning to running"):
        StateMachine().advance(Phase.RUNNING)


def test_elastic_config_names_the_bad_field():
    with pytest.raises(ValueError, match="ElasticConfig.num_spares"):
        ElasticConfig(num_spares=-1)
    with pytest.raises(ValueError, match="ElasticConfig.min_workers"):
        ElasticConfig(min_workers=8, max_workers=4)
    with pytest.raises(ValueError, match="persist_path"):
        ElasticConfig(persist_every=10)


def test_step_deadline_scales_with_the_median_step_and_has_a_floor():
    config = ElasticConfig(collective_timeout_floor_s=0.5, collective_timeout_factor=5.0)  # not the defaults
    assert config.step_deadline_s(None) == config.first_steps_timeout_s
    assert config.step_deadline_s(0.01) == 0.5
    assert config.step_deadline_s(1.0) == 5.0


def test_a_fault_is_armed_once_even_when_its_step_runs_again():
    plan = FaultPlan().crash(rank=2, step=25).slow(rank=1, step=25, speed=0.5)
    assert set(plan.arm(25)) == {1, 2}
    assert plan.arm(25) == {}
    assert plan.count(FaultKind.CRASH) == 1 and plan.count(FaultKind.HANG) == 0


def test_a_regroup_fault_fires_in_the_first_regroup_at_its_step_or_later_and_only_there():
    plan = FaultPlan().crash(rank=2, step=3).crash_while_regrouping(rank=1, step=4)
    assert plan.arm_regroup(0) == {}
    assert 1 not in plan.arm(4) and 2 in plan.arm(3)
    armed = plan.arm_regroup(6)
    assert list(armed) == [1] and armed[1].kind is FaultKind.CRASH
    assert plan.arm_regroup(7) == {}


def test_sizes_keep_whole_replicas_and_an_evenly_split_batch():
    job = TrainJob(model=MLPConfig(), train=TrainConfig(num_steps=1, global_batch_size=24))
    assert valid_sizes(job, ParallelLayout(dp=8), 1, 8) == (1, 2, 3, 4, 6, 8)
    assert valid_sizes(job, ParallelLayout(dp=2, tp=2), 2, 8) == (2, 4, 6, 8)
    assert layout_for(ParallelLayout(dp=2, tp=2), 6).dp == 3
    with pytest.raises(ValueError, match="multiple of tp x pp"):
        layout_for(ParallelLayout(dp=2, tp=2), 5)


def test_pure_data_parallel_gpt_jobs_also_run_at_sizes_that_split_the_batch_unevenly():
    from baige_ray.models.gpt import GPTConfig

    job = TrainJob(model=GPTConfig(), train=TrainConfig(num_steps=1, global_batch_size=84))
    assert valid_sizes(job, ParallelLayout(dp=7), 3, 7) == (3, 4, 5, 6, 7)
    assert layout_for(ParallelLayout(dp=7), 5, job).dp_microbatches == (17, 17, 17, 17, 16)
    assert layout_for(ParallelLayout(dp=7), 6, job).dp_microbatches is None  # 84 = 6 x 14
    # Tensor or pipeline parallel jobs, and MLP jobs, keep to even splits.
    assert valid_sizes(job, ParallelLayout(dp=2, tp=2), 2, 8) == (2, 4, 6, 8)
    mlp = TrainJob(model=MLPConfig(), train=TrainConfig(num_steps=1, global_batch_size=84))
    assert valid_sizes(mlp, ParallelLayout(dp=7), 3, 7) == (3, 4, 6, 7)
    # With micro-batches the shares count whole micro-batches: 84 = 21 micro-batches of 4.
    micro = TrainJob(model=GPTConfig(), train=TrainConfig(num_steps=1, global_batch_size=84, micro_batch_size=4))
    assert layout_for(ParallelLayout(dp=7), 5, micro).dp_microbatches == (5, 4, 4, 4, 4)


def test_snapshot_restores_the_exact_state_of_the_step_it_was_taken_after():
    job = TrainJob(model=MLPConfig(sizes=(16, 32, 8)), train=TrainConfig(num_steps=8, global_batch_size=8))
    engine = build_engine(job, ParallelLayout())
    snapshots = HostSnapshotter(engine)
    for step in range(3):
        engine.train_step(step)
        snapshots.after_step(step)
    step, state = snapshots.latest()
    continued = engine.train_step(3)["loss"]
    restored = build_engine(job, ParallelLayout())
    restored.import_state(state)
    assert step == 2
    assert restored.train_step(3)["loss"] == continued
    for name, param in restored.module.named_parameters():
        assert torch.equal(param, dict(engine.module.named_parameters())[name])


def test_a_small_state_is_copied_on_the_training_thread_and_a_large_one_beside_it(monkeypatch):
    import baige_ray.elastic.snapshot as snapshot_module

    job = TrainJob(model=MLPConfig(sizes=(16, 32, 8)), train=TrainConfig(num_steps=8, global_batch_size=8))
    engine = build_engine(job, ParallelLayout())
    snapshots = HostSnapshotter(engine)
    threads = []
    started = snapshot_module.threading.Thread.start
    monkeypatch.setattr(snapshot_module.threading.Thread, "start", lambda t: threads.append(t.name) or started(t))
    for step in range(2):  # the first copy's size is not known yet: it goes to a thread
        engine.train_step(step)
        snapshots.after_step(step)
    assert threads == ["snapshot-0"] and snapshots.latest()[0] == 1
    monkeypatch.setattr(snapshot_module, "INLINE_COPY_BYTES", 100)  # this MLP's state is about 10 kB
    engine.train_step(2)
    snapshots.after_step(2)
    assert threads == ["snapshot-0", "snapshot-2"]


def test_the_weights_copy_for_serving_is_packed_private_and_without_optimizer_state():
    job = TrainJob(model=MLPConfig(sizes=(16, 32, 8)), train=TrainConfig(num_steps=8, global_batch_size=8))
    engine = build_engine(job, ParallelLayout())
    snapshots = HostSnapshotter(engine)
    engine.train_step(0)
    snapshots.after_step(0)
    step, weights = snapshots.latest_weights_copy()
    _, full = snapshots.latest()
    assert step == 0 and isinstance(weights["model"], PackedTensors) and weights["optimizer"] == {}
    expected = {name: tensor.clone() for name, tensor in full["model"].items()}
    for later in (1, 2):  # the snapshot's buffers are reused two steps later: the copy must not see it
        engine.train_step(later)
        snapshots.after_step(later)
    now = snapshots.latest()[1]["model"]
    assert any(not torch.equal(now[name], tensor) for name, tensor in expected.items())  # training moved on
    assert all(torch.equal(weights["model"][name], tensor) for name, tensor in expected.items())
