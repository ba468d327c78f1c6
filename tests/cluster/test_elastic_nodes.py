"""Losing and regaining a whole node: shrink onto the survivors, grow back when the node returns.

On the simulated 4x2 cluster, 8 workers fill every fake GPU; removing a node takes
2 of them. The 24-sequence global batch splits over 6 as over 8 replicas, so the
mathematics of every step is unchanged and the run agrees with a fault-free one.
"""

from __future__ import annotations

import time

import pytest
import torch

from baige_ray.elastic.config import ElasticConfig
from baige_ray.topology.simulated import SimulatedCluster
from tests.helpers import elastic_mlp_run, final_parameters

NUM_STEPS = 400


def wait_for(job, predicate, timeout_s: float, what: str) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        status = job.status()
        if predicate(status):
            return status
        assert time.monotonic() < deadline, f"timed out waiting for {what}; status: {status['state']} step {status['step']}"
        time.sleep(0.05)


@pytest.fixture(autouse=True)
def no_leftover_actors(sim_cluster_4x2):
    yield
    from baige_ray.elastic.job import kill_run_actors

    kill_run_actors("elastic-")


def test_a_removed_node_shrinks_the_job_and_a_returning_node_grows_it_back(sim_cluster_4x2, tmp_path):
    cluster = SimulatedCluster.active()
    elastic = ElasticConfig(num_spares=0, min_workers=2, max_workers=8, grow_check_interval_s=0.5)
    job = elastic_mlp_run("elastic-nodes", tmp_path, num_workers=8, num_steps=NUM_STEPS, elastic=elastic)
    wait_for(job, lambda s: s["step"] >= 10, 180, "step 10")
    node_type = next(iter(cluster.descriptor.node_types))
    cluster.remove_node(3)
    shrunk = wait_for(job, lambda s: s["num_workers"] == 6 and s["state"] == "running", 60, "the shrink to 6")
    resumed_at = shrunk["step"]
    wait_for(job, lambda s: s["step"] > resumed_at + 3, 60, "steps after the shrink")
    cluster.add_node(node_type, 3)
    wait_for(job, lambda s: s["num_workers"] == 8, 120, "the growth back to 8")
    result = job.wait()

    assert [m.step for m in result.metrics] == list(range(NUM_STEPS))
    crash_recovery = result.recoveries[0]
    assert crash_recovery["lost_steps"] <= 1
    print(f"node loss: training continued {crash_recovery['recovery_s']:.2f}s after the failed step began")
    reference = final_parameters(elastic_mlp_run("elastic-nodes-reference", tmp_path, num_workers=8,
                                                 num_steps=NUM_STEPS, elastic=elastic).wait())
    final = final_parameters(result)
    for name in reference:
        torch.testing.assert_close(final[name], reference[name], rtol=1e-5, atol=1e-7)
