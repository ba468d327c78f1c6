"""The topology actor on the shared simulated 2x4 cluster: graph == descriptor, and it follows joins/leaves."""

from __future__ import annotations

import numpy as np
import pytest
import ray

from baige_ray.actors.topology import start_topology_actor
from baige_ray.topology.graph import LinkTier, ResourceGraph
from baige_ray.topology.simulated import SimulatedCluster

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def topology(sim_cluster):
    if not sim_cluster.simulated:
        pytest.skip("needs the simulated cluster (RAY_ADDRESS points at a real one)")
    actor = start_topology_actor(descriptor=sim_cluster.descriptor, poll_interval_s=0.2)
    yield actor
    ray.get(actor.stop.remote())
    ray.kill(actor)


def _same_devices(left: ResourceGraph, right: ResourceGraph) -> None:
    for column in ("device_id", "node", "local", "island", "rail", "leaf", "pod", "memory_gb", "speed"):
        np.testing.assert_array_equal(getattr(left.devices, column), getattr(right.devices, column), column)


def test_actor_graph_matches_descriptor(sim_cluster, topology):
    graph = ray.get(topology.graph.remote())
    _same_devices(graph, ResourceGraph.from_descriptor(sim_cluster.descriptor))
    membership = ray.get(topology.membership.remote())
    assert sorted(membership) == [0, 1]
    alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    assert set(membership.values()) <= alive
    assert graph.tier_between(0, 4) == LinkTier.SAME_RAIL


def test_graph_follows_a_node_joining_and_leaving(sim_cluster, topology):
    cluster = SimulatedCluster.active()
    before = ray.get(topology.version.remote())
    cluster.add_node("sim-a100-node", 2)
    try:
        joined = ray.get(topology.wait_for_version.remote(before, 30.0))
        grown = ray.get(topology.graph.remote())
        assert joined > before
        assert grown.num_nodes == 3 and grown.num_devices == 12
        assert grown.devices_of_node(2).tolist() == [8, 9, 10, 11]
    finally:
        cluster.remove_node(2)
    left = ray.get(topology.wait_for_version.remote(joined, 60.0))
    shrunk = ray.get(topology.graph.remote())
    assert left > joined
    _same_devices(shrunk, ResourceGraph.from_descriptor(sim_cluster.descriptor))
