"""Elastic recovery of a Hugging Face model: a crashed worker replaced from a spare, a lost node shrunk away.

The tiny Llama of tests/hf_helpers.py on the simulated 4x2 cluster (next to test_elastic_nodes.py,
so the cluster is started once for both). Each faulty run is compared with its fault-free twin.
"""

from __future__ import annotations

import pytest
import ray
import torch

from baige_ray.elastic.config import ElasticConfig
from baige_ray.elastic.faults import FaultPlan
from baige_ray.topology.simulated import SimulatedCluster
from tests.cluster.test_elastic_nodes import wait_for
from tests.hf_helpers import build_tiny_hf, elastic_hf_run


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_hf(tmp_path_factory.mktemp("tiny-llama-elastic"))


@pytest.fixture(autouse=True)
def no_leftover_actors(sim_cluster_4x2):
    yield
    from baige_ray.elastic.job import kill_run_actors

    kill_run_actors("elastic-hf")


def final_weights(result) -> dict[str, torch.Tensor]:
    return ray.get(result.final_state)["model"]


def test_a_crashed_worker_of_a_hf_model_is_replaced_from_a_spare_and_training_agrees(tiny, tmp_path):
    elastic = ElasticConfig(num_spares=1)
    result = elastic_hf_run("elastic-hf-crash", tmp_path, tiny, num_workers=4, num_steps=12, elastic=elastic,
                            faults=FaultPlan().crash(rank=2, step=6)).wait()
    assert [m.step for m in result.metrics] == list(range(12))
    assert len(result.recoveries) == 1 and result.recoveries[0]["lost_steps"] <= 1
    reference = elastic_hf_run("elastic-hf-crash-reference", tmp_path, tiny, num_workers=4, num_steps=12,
                               elastic=elastic).wait()
    final, expected = final_weights(result), final_weights(reference)
    assert final.keys() == expected.keys() and "model.layers.0.self_attn.k_proj.weight" in final
    for name in expected:
        # Measured: every tensor bitwise equal but the token embedding (1.5e-6 relative: its CPU backward
        # accumulates rows in an order that is not fixed across processes).
        torch.testing.assert_close(final[name], expected[name], rtol=1e-5, atol=1e-7)


def relative_difference(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


def test_a_lost_node_shrinks_a_hf_job_and_training_agrees_with_a_fault_free_run(tiny, tmp_path):
    cluster = SimulatedCluster.active()
    elastic = ElasticConfig(num_spares=0, min_workers=2, max_workers=8)
    num_steps = 16
    job = elastic_hf_run("elastic-hf-node", tmp_path, tiny, num_workers=8, num_steps=num_steps, elastic=elastic,
                         learning_rate=1e-3)
    wait_for(job, lambda s: s["step"] >= 3, 180, "step 3")
    node_type = next(iter(cluster.descriptor.node_types))
    cluster.remove_node(3)
    try:
        result = job.wait()
    finally:
        cluster.add_node(node_type, 3)
    assert [m.step for m in result.metrics] == list(range(num_steps))
    assert len(result.recoveries) == 1 and result.recoveries[0]["lost_steps"] <= 1
    assert result.num_workers == 6 and result.layout.startswith("DP6")
    reference = elastic_hf_run("elastic-hf-node-reference", tmp_path, tiny, num_workers=8, num_steps=num_steps,
                               elastic=elastic, learning_rate=1e-3).wait()
    # DP6 and DP8 sum gradients in different orders; Adam carries that rounding forward (at lr 3e-3 the
    # losses agreed within 1e-7 for ten steps after the shrink, then drifted: 6e-6 by step 30; weights 1.7e-5 by
    # step 16, 1e-3 halves that).
    assert [m.loss for m in result.metrics] == pytest.approx([m.loss for m in reference.metrics], rel=1e-5)
    final, expected = final_weights(result), final_weights(reference)
    differences = {name: relative_difference(final[name], expected[name]) for name in expected}
    print("largest relative difference after the shrink:", max(differences.items(), key=lambda item: item[1]))
    assert max(differences.values()) <= 1e-5, differences
