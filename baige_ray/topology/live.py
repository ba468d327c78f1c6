"""The live cluster's ResourceGraph, discovered from Ray's node table and the nodes' probes.

In-process: the planner and `baige-ray topo` build a graph with it once; the topology actor
(actors/topology.py) keeps one current by refreshing it every second. Two modes:

- simulated (a descriptor is given): Ray nodes are matched to descriptor nodes
  by their `baige_node_{i}` / `baige_type_{name}` resources; the graph holds
  exactly the matched nodes, so a node that leaves drops out and a node that
  joins (even past the descriptor's count) appears with its type's profile.
- real (no descriptor): one `probe_node` task per node, pinned there with
  NodeAffinitySchedulingStrategy; results are cached per Ray node id, so only
  joining nodes are probed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from baige_ray.topology.descriptor import ClusterDescriptor, NetworkSpec
from baige_ray.topology.discovery import alive_nodes, assign_node_ids, simulated_nodes
from baige_ray.topology.graph import ResourceGraph
from baige_ray.topology.layout import NodeProfile
from baige_ray.topology.probe_node import probe_node, profile_from_probe
from baige_ray.topology.probe_types import NodeProbe

logger = logging.getLogger(__name__)
ProbeRunner = Callable[[list[str]], dict[str, NodeProbe]]


class LiveTopology:
    """Holds the current graph; `refresh()` re-reads membership and bumps `version()` on change."""

    def __init__(self, *, descriptor: ClusterDescriptor | None = None, network: NetworkSpec | None = None,
                 list_nodes: Callable[[], list[Mapping]] | None = None,
                 run_probes: ProbeRunner | None = None, sys_root: str = "/"):
        self.descriptor = descriptor
        self.network = network or (descriptor.network if descriptor else NetworkSpec())
        self._list_nodes = list_nodes or _ray_nodes
        self._run_probes = run_probes or (lambda ids: probe_on_nodes(ids, sys_root))
        self._lock = threading.Lock()
        self._membership: dict[int, str] = {}  # graph node id -> Ray node id
        self._probes: dict[str, NodeProbe] = {}
        self._node_ids: dict[str, int] = {}
        self._sim_types: dict[int, str] = {}
        self._version = 0
        self._graph = self._build({})
        self.refresh()

    # ---- served to the planner and the controller ---------------------------------------

    def graph(self) -> ResourceGraph:
        with self._lock:
            return self._graph

    def version(self) -> int:
        with self._lock:
            return self._version

    def membership(self) -> dict[int, str]:
        """Graph node id -> Ray node id of every node in the current graph."""
        with self._lock:
            return dict(self._membership)

    def probes(self) -> dict[str, NodeProbe]:
        """Raw probe results by Ray node id (real mode only)."""
        with self._lock:
            return dict(self._probes)

    def wait_for_version(self, newer_than: int, timeout_s: float = 30.0) -> int:
        """Block until the graph changes past `newer_than` (or the timeout); return the version."""
        deadline = time.monotonic() + timeout_s
        while self.version() <= newer_than and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.version()

    # ---- discovery -------------------------------------------------------------------------

    def refresh(self) -> int:
        """Read Ray's node table once; rebuild the graph when membership changed."""
        nodes = self._list_nodes()
        membership = self._simulated_membership(nodes) if self.descriptor else self._real_membership(nodes)
        with self._lock:
            if membership == self._membership:
                return self._version
        graph = self._build(membership)
        with self._lock:
            self._membership, self._graph = membership, graph
            self._version += 1
            logger.info("topology v%d: %d nodes, %d devices", self._version, graph.num_nodes, graph.num_devices)
            return self._version

    def _simulated_membership(self, nodes: list[Mapping]) -> dict[int, str]:
        found = simulated_nodes(nodes, self.descriptor.node_types)
        self._sim_types = {index: node.node_type for index, node in found.items()}
        return {index: node.ray_node_id for index, node in sorted(found.items())}

    def _real_membership(self, nodes: list[Mapping]) -> dict[int, str]:
        alive = {node["NodeID"] for node in alive_nodes(nodes)}
        missing = sorted(alive - set(self._probes))
        if missing:
            self._probes.update(self._run_probes(missing))
        self._node_ids = assign_node_ids(
            [n for n in nodes if n["NodeID"] in self._probes], self._node_ids)
        return {node_id: ray_id for ray_id, node_id in sorted(self._node_ids.items(), key=lambda kv: kv[1])}

    def _build(self, membership: dict[int, str]) -> ResourceGraph:
        if self.descriptor is not None:
            present = {index: self._sim_types[index] for index in membership} if membership else {}
            graph = ResourceGraph.from_descriptor(self.descriptor, present)
            return graph.with_node_names(membership)
        profiles: dict[str, NodeProfile] = {}
        node_ids: dict[str, list[int]] = {}
        for node_id, ray_id in membership.items():
            profile = profile_from_probe(self._probes[ray_id], self.network)
            key = f"{profile.name}#{node_id}"
            profiles[key], node_ids[key] = profile, [node_id]
        if not profiles:
            profiles["empty"] = profile_from_probe(NodeProbe(hostname="empty", num_cpus=1, memory_gb=1.0),
                                                   self.network)
        return ResourceGraph.from_profiles(profiles, node_ids, self.network, name="ray-cluster",
                                           node_names=membership)


def _ray_nodes() -> list[dict[str, Any]]:
    import ray

    return ray.nodes()


def probe_on_nodes(ray_node_ids: list[str], sys_root: str = "/", timeout_s: float = 30.0) -> dict[str, NodeProbe]:
    """Run `probe_node` once on each Ray node, pinned there; nodes that fail to answer are skipped."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # Zero CPUs: the probe must run even on a node whose slots are all taken by workers.
    task = ray.remote(num_cpus=0, max_retries=0)(probe_node)
    refs = {node_id: task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
            .remote(sys_root) for node_id in ray_node_ids}
    results = {}
    for node_id, ref in refs.items():
        try:
            results[node_id] = ray.get(ref, timeout=timeout_s)
        except Exception:  # a node dying mid-probe: it is absent from the next membership anyway
            logger.warning("probe on node %s failed", node_id, exc_info=True)
    return results
