"""The topology actor in real mode on a local Ray: one pinned probe per node, CPU-only reported as such."""

from __future__ import annotations

import pytest
import ray

from baige_ray.actors.topology import start_topology_actor
from baige_ray.topology.live import probe_on_nodes

pytestmark = pytest.mark.ray


def test_probe_runs_pinned_on_each_node(local_ray):
    node_ids = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
    probes = probe_on_nodes(node_ids)
    assert sorted(probes) == sorted(node_ids)
    for probe in probes.values():
        assert probe.num_cpus >= 1 and probe.memory_gb > 0
        # This CI box has no NVIDIA driver: the probe must say CPU-only, not invent GPUs.
        assert probe.cpu_only == (probe.source == "none")


def test_actor_serves_a_graph_of_the_live_nodes(local_ray):
    actor = start_topology_actor(start_polling=False)
    try:
        graph = ray.get(actor.graph.remote())
        probes = ray.get(actor.probes.remote())
        assert graph.num_nodes == len([n for n in ray.nodes() if n["Alive"]])
        assert graph.num_devices == sum(len(p.gpus) for p in probes.values())
        assert ray.get(actor.version.remote()) == 1
        assert ray.get(actor.refresh.remote()) == 1  # unchanged membership keeps the version
    finally:
        ray.kill(actor)
