"""The elastic controller on the simulated 2x4 cluster: crashes, hangs, stragglers and its own restart.

Every job is the recovery scenario's MLP (smaller, so each runs in seconds) with
4 workers; its fault-free twin is the reference. A crash or hang with a spare keeps
the world size and the data slices, so the result is bitwise the same.
"""

from __future__ import annotations

import time

import pytest
import ray
import torch

from baige_ray.api.elastic import ElasticConfig
from baige_ray.elastic.faults import FaultPlan
from tests.helpers import elastic_mlp_run, final_parameters


@pytest.fixture(autouse=True)
def no_leftover_actors(sim_cluster):
    """A failed test must not leave detached workers holding the next test's devices."""
    yield
    from tests.helpers import kill_runs_named

    kill_runs_named("elastic-")


@pytest.fixture(scope="module")
def reference(sim_cluster, tmp_path_factory):
    # No spare: it would change no bit, only start one more process.
    result = elastic_mlp_run("elastic-reference", tmp_path_factory.mktemp("reference"),
                             elastic=ElasticConfig(num_spares=0)).wait()
    return final_parameters(result)


def assert_bitwise_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name


def test_a_crash_is_replaced_by_a_spare_and_training_is_bitwise_unchanged(reference, tmp_path):
    job = elastic_mlp_run("elastic-crash", tmp_path, faults=FaultPlan().crash(rank=2, step=8))
    result = job.wait()
    assert len(result.recoveries) == 1
    assert result.recoveries[0]["lost_steps"] <= 1
    assert [m.step for m in result.metrics] == list(range(15))
    assert_bitwise_equal(final_parameters(result), reference)


def test_a_worker_lost_while_regrouping_does_not_hold_the_others_in_the_rendezvous(reference, tmp_path):
    """Rank 2 crashes; while the rest wait for everyone to join the replacement group, rank 1 crashes
    too. The survivors are released at once (not after the 60 s rendezvous timeout) and join again."""
    faults = FaultPlan().crash(rank=2, step=8).crash_while_regrouping(rank=1, step=1)  # the first after the start
    job = elastic_mlp_run("elastic-regroup-crash", tmp_path, faults=faults, elastic=ElasticConfig(num_spares=2))
    result = job.wait()
    assert [m.step for m in result.metrics] == list(range(15))
    assert_bitwise_equal(final_parameters(result), reference)
    events = (next(tmp_path.rglob("elastic-regroup-crash/events.jsonl"))).read_text()
    assert "lost while regrouping" in events
    recovery_s = sum(r["recovery_s"] for r in result.recoveries)
    print(f"a crash, then a crash while regrouping: {recovery_s:.2f}s of recovery in all")
    assert recovery_s < 30, "the survivors sat out the rendezvous timeout"


def test_a_frozen_worker_is_detected_by_heartbeats_and_replaced(reference, tmp_path):
    job = elastic_mlp_run("elastic-hang", tmp_path, faults=FaultPlan().hang(rank=1, step=6))
    result = job.wait()
    assert len(result.recoveries) == 1
    assert_bitwise_equal(final_parameters(result), reference)
    events = (tmp_path / "elastic-hang" / "events.jsonl").read_text()
    assert "stopped answering heartbeats" in events or "still running" in events


def test_a_persistent_straggler_is_evicted_and_training_goes_on(reference, tmp_path):
    elastic = ElasticConfig(num_spares=0, min_workers=2, straggler_patience=3, straggler_threshold=1.5)
    job = elastic_mlp_run("elastic-straggler", tmp_path, elastic=elastic, num_steps=20,
                          faults=FaultPlan().slow(rank=3, step=4, speed=0.01))
    result = job.wait()
    events = (tmp_path / "elastic-straggler" / "events.jsonl").read_text()
    assert '"kind": "straggler"' in events and '"kind": "eviction"' in events
    assert len(result.workers) == 3  # 24 sequences split over 3 replicas
    assert [m.step for m in result.metrics] == list(range(20))


def test_the_controller_resumes_after_its_own_crash(reference, tmp_path):
    job = elastic_mlp_run("elastic-controller-crash", tmp_path, num_steps=15)
    deadline = time.monotonic() + 120
    while job.status()["step"] < 5:
        assert time.monotonic() < deadline, "job never reached step 5"
        time.sleep(0.05)
    ray.kill(job.controller, no_restart=False)  # Ray restarts it; the pending run() is retried on it
    result = job.wait()
    assert [m.step for m in result.metrics] == list(range(15)), "the history from before the restart is kept"
    deadline = time.monotonic() + 10  # ray.kill returns before the actor is gone
    while left := [entry["name"] for entry in ray.util.list_named_actors(all_namespaces=True)
                   if entry["name"].startswith("baige-worker:elastic-controller-crash:")]:
        assert time.monotonic() < deadline, f"workers outlived the job (the dead controller's spare?): {left}"
        time.sleep(0.2)
    final = final_parameters(result)
    for name in reference:
        torch.testing.assert_close(final[name], reference[name], rtol=1e-5, atol=0)
