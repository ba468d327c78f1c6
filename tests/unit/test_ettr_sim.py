"""The effective-training-time simulation (bench/ettr_sim.py) against hand-computed runs of one or two faults."""

from __future__ import annotations

import pytest

from baige_ray.bench.ettr_sim import (
    ElasticRecovery,
    Fault,
    FaultClass,
    Job,
    RestartRecovery,
    fault_trace,
    simulate,
)

GB = 1e9
JOB = Job(devices=64, devices_per_node=8, replica_devices=16, step_s=10.0, state_bytes=4 * GB)  # 4 replicas
CRASH = FaultClass(name="software bug", per_device_hour=1e-5, scope="process")
FREEZE = FaultClass(name="NCCL watchdog", per_device_hour=1e-5, scope="process", hangs=True)
GPU = FaultClass(name="faulty GPU", per_device_hour=1e-5, scope="device")
SDC = FaultClass(name="silent data corruption", per_device_hour=1e-6, scope="corruption")


def elastic(**changes) -> ElasticRecovery:
    base = dict(detect_crash_s=0.5, detect_hang_s=2.0, regroup_s=3.0, local_restore_bytes_per_s=2 * GB,
                peer_restore_bytes_per_s=1 * GB, storage_read_bytes_per_s=0.5 * GB, persist_every_s=1800.0,
                stall_fraction=0.0, corruption_detect_s=600.0)
    return ElasticRecovery(**(base | changes))


def restart(**changes) -> RestartRecovery:
    base = dict(detect_crash_s=0.5, hang_timeout_s=600.0, restart_s=60.0, storage_read_bytes_per_s=0.5 * GB,
                storage_write_bytes_per_s=0.5 * GB, checkpoint_interval_s=1800.0, corruption_detect_s=600.0)
    return RestartRecovery(**(base | changes))


def test_elastic_process_crash_restores_locally_and_redoes_part_of_a_step():
    out = simulate(elastic(), JOB, [Fault(at_s=1000.0, kind=CRASH)], hours=1.0, spare_nodes=0, repair_s=3600.0)
    assert out.down_s == pytest.approx(0.5 + 3.0 + 4 * GB / (2 * GB))
    assert 0.0 <= out.redone_s <= JOB.step_s
    assert out.shrunk_s == 0.0 and out.persisted_restores == 0 and out.persist_stall_s == 0.0


def test_elastic_lost_gpu_takes_a_spare_and_pulls_a_peers_copy():
    out = simulate(elastic(), JOB, [Fault(at_s=1000.0, kind=GPU)], hours=1.0, spare_nodes=1, repair_s=3600.0)
    assert out.down_s == pytest.approx(0.5 + 3.0 + 4.0)
    assert out.spares_exhausted == 0 and out.shrunk_s == 0.0


def test_elastic_without_a_spare_runs_smaller_until_the_node_is_repaired():
    out = simulate(elastic(), JOB, [Fault(at_s=1000.0, kind=GPU)], hours=2.0, spare_nodes=0, repair_s=3600.0)
    assert out.spares_exhausted == 1
    # one of 4 replicas lost from the fault until the repair, an hour later; then a regroup to grow back
    assert out.shrunk_s == pytest.approx(3600.0 / 4)
    assert out.down_s == pytest.approx(0.5 + 3.0 + 4.0 + 3.0)


def test_restart_redoes_the_work_since_the_last_checkpoint_and_stalls_for_each():
    out = simulate(restart(), JOB, [Fault(at_s=2700.0, kind=CRASH)], hours=2.0, spare_nodes=0, repair_s=3600.0)
    down = 0.5 + 60.0 + 4 * GB / (0.5 * GB)
    assert out.down_s == pytest.approx(down)
    assert out.redone_s == pytest.approx(900.0)  # 45 min in, the 30-min checkpoint is 15 min old
    assert out.persist_stall_s == pytest.approx((7200.0 - down) / 1800.0 * 8.0)


def test_restart_notices_a_hang_only_at_the_collective_timeout():
    out = simulate(restart(), JOB, [Fault(at_s=100.0, kind=FREEZE)], hours=1.0, spare_nodes=0, repair_s=3600.0)
    assert out.down_s == pytest.approx(600.0 + 60.0 + 8.0)
    ours = simulate(elastic(), JOB, [Fault(at_s=100.0, kind=FREEZE)], hours=1.0, spare_nodes=0, repair_s=3600.0)
    assert ours.down_s == pytest.approx(2.0 + 3.0 + 2.0)


def test_restart_without_a_spare_waits_for_the_repair():
    out = simulate(restart(), JOB, [Fault(at_s=100.0, kind=GPU)], hours=3.0, spare_nodes=0, repair_s=3600.0)
    assert out.down_s == pytest.approx(3600.0 + 0.5 + 60.0 + 8.0)


def test_corruption_goes_back_to_the_persisted_checkpoint_in_both():
    for strategy, resume in ((elastic(), 0.5 + 3.0 + 8.0), (restart(), 0.5 + 60.0 + 8.0)):
        out = simulate(strategy, JOB, [Fault(at_s=2000.0, kind=SDC)], hours=1.0, spare_nodes=0, repair_s=3600.0)
        assert out.persisted_restores == 1
        assert out.down_s == pytest.approx(resume + 600.0)
        assert out.redone_s == pytest.approx(200.0 + 600.0)  # 200 s past the 30-min checkpoint, then unnoticed


def test_a_fault_during_a_recovery_waits_for_it():
    trace = [Fault(at_s=100.0, kind=GPU), Fault(at_s=101.0, kind=CRASH)]
    out = simulate(restart(), JOB, trace, hours=1.0, spare_nodes=2, repair_s=3600.0)
    assert out.down_s == pytest.approx(2 * (0.5 + 60.0 + 8.0))
    assert out.faults == 2 and out.by_scope == {"device": 1, "process": 1}


def test_fault_trace_rate_and_mix():
    kinds = [GPU, FaultClass(name="other", per_device_hour=3e-5, scope="host")]
    trace = fault_trace(kinds, devices=10_000, hours=2_500.0, seed=0)  # expected 1,000 faults
    assert 900 < len(trace) < 1100
    assert 0.2 < sum(f.kind is GPU for f in trace) / len(trace) < 0.3
    assert [f.at_s for f in trace] == sorted(f.at_s for f in trace)
    assert fault_trace(kinds, devices=10_000, hours=2_500.0, seed=0) == trace


def test_invalid_inputs_name_the_field():
    with pytest.raises(ValueError, match="scope"):
        FaultClass(name="x", per_device_hour=1e-5, scope="rack")
    with pytest.raises(ValueError, match="devices_per_node"):
        Job(devices=60, devices_per_node=8, replica_devices=8, step_s=1.0, state_bytes=1.0)


def test_published_failures_give_llama3s_rate_and_mix():
    from baige_ray.bench.ettr import load_failures

    kinds, source = load_failures()
    per_device_hour = sum(k.per_device_hour for k in kinds)
    assert per_device_hour * 16384 * 54 * 24 == pytest.approx(419)
    assert {k.scope for k in kinds} == {"process", "device", "host", "corruption"}
    assert source["baseline_hang_timeout_s"] == 600.0
