"""bench scale's elastic report: stall as a fraction of the step, the kill's detection from the event log."""

import pytest

from baige_ray.api.result import Result, StepMetrics
from baige_ray.bench.scale_faults import _report


def test_the_elastic_report_measures_stall_detection_and_the_loss_against_fit():
    metrics = [StepMetrics(step=s, loss=5.0 - s, learning_rate=1e-3, step_time_s=10.0, tokens=512,
                           peak_host_memory_gb=9.5, snapshot_stall_s=0.1 * s) for s in range(6)]
    result = Result(metrics=metrics, recoveries=[{"recovery_s": 31.5, "lost_steps": 1,
                                                  "phases_s": {"detected": 6.4, "regrouped": 16.4}}])
    events = [{"time": 90.0, "kind": "failure", "reason": "earlier"},
              {"time": 101.25, "kind": "failure", "reason": "rank 1: died"}]
    kill = {"step": 4, "time": 100.0, "pid": 7, "shelf_bytes": 6_000_000_000}
    report = _report(result, events, kill, reference_losses=[5.0, 4.0, 3.0, 2.0, 1.5], warmup=1)
    assert report["stall_frac"] == pytest.approx(0.03)  # median of 0.01..0.05
    assert report["stall_frac_max"] == pytest.approx(0.05)
    assert report["detection_s"] == 1.25 and report["recovery_s"] == 31.5 and report["steps_lost"] == 1
    assert report["snapshot_bytes_per_worker"] == 3_000_000_000 and report["snapshot_host_gb"] == 6.0
    assert report["loss_max_abs_diff"] == 0.5
    assert report["regrouped_after_kill_s"] == 11.25  # noticed 1.25 s after the kill, regrouped 10 s later


def test_persistence_is_the_fastest_checkpoint_against_a_plain_write_of_as_many_bytes(tmp_path):
    from baige_ray.bench.scale_faults import _persistence

    events = [{"time": 1.0, "kind": "checkpoint", "reason": "persisted step 2", "bytes": 8 << 20, "seconds": 4.0},
              {"time": 2.0, "kind": "checkpoint", "reason": "persisted step 5", "bytes": 8 << 20, "seconds": 2.0}]
    report = _persistence(events, tmp_path / "scratch")
    assert report["persist_s"] == 2.0 and report["checkpoints_written"] == 2
    assert report["persist_vs_write"] == pytest.approx(report["write_s"] / 2.0, abs=1e-3)  # both rounded
    assert not list((tmp_path / "scratch").iterdir())  # the plain file goes
    failed = _persistence([{"time": 1.0, "kind": "checkpoint", "reason": "persisting step 2 failed: disk full"}], tmp_path)
    assert failed == {"persist_vs_write": None, "persist_note": "persisting step 2 failed: disk full"}
