"""The slowest link inside a device group, without enumerating pairs.

A group of 16,384 devices has 134M pairs; the planner asks this question for
every candidate tensor/pipeline/data group, so the answer is computed per
device from group counts instead. For cross-node traffic the bandwidth of a
pair is min(nic_a, nic_b) / divisor(tier), and the minimum over all pairs equals
the minimum over devices a of nic_a / (largest divisor among a's partners on
other nodes), because every pair is seen from both ends.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from baige_ray.topology.graph import LinkSummary, LinkTier, ResourceGraph


def slowest_link(graph: ResourceGraph, device_ids: ArrayLike) -> LinkSummary | None:
    """Slowest tier, lowest pairwise bandwidth and highest latency inside a group of `graph`'s devices;
    None below 2 devices. Vectorized over the group (sorting, no pairs)."""
    positions = graph.positions(np.atleast_1d(device_ids))
    if len(positions) < 2:
        return None
    candidates = [_intra_node(graph, positions), _cross_node(graph, positions)]
    candidates = [c for c in candidates if c is not None]
    return LinkSummary(
        tier=LinkTier(max(c[0] for c in candidates)),
        bandwidth_gb_per_s=float(min(c[1] for c in candidates)),
        latency_us=float(max(c[2] for c in candidates)),
    )


def _counts(*keys: np.ndarray) -> np.ndarray:
    """For each row, how many rows share its key tuple (tuples packed into one int64 key)."""
    packed = np.zeros(len(keys[0]), dtype=np.int64)
    for key in keys:
        key = key.astype(np.int64)
        low = key.min()
        packed = packed * (int(key.max() - low) + 1) + (key - low)
    _, inverse, counts = np.unique(packed, return_inverse=True, return_counts=True)
    return counts[inverse.reshape(-1)]


def _intra_node(graph: ResourceGraph, pos: np.ndarray) -> tuple[int, float, float] | None:
    """Worst pair inside any node holding two or more group devices."""
    d = graph.devices
    node, island, profile = d.node[pos], d.island[pos], d.profile[pos]
    shared = _counts(node) >= 2
    if not shared.any():
        return None
    # A node is split across islands when its devices in the group do not all share one island.
    split = _counts(node, island)[shared] < _counts(node)[shared]
    profile = profile[shared]
    bandwidth = np.where(split, graph._pcie_gb[profile], graph._island_gb[profile])
    latency = np.where(split, graph._pcie_lat[profile], graph._island_lat[profile])
    tier = LinkTier.PCIE if split.any() else LinkTier.NVLINK
    return int(tier), float(bandwidth.min()), float(latency.max())


def _cross_node(graph: ResourceGraph, pos: np.ndarray) -> tuple[int, float, float] | None:
    d = graph.devices
    node, pod, leaf, rail = d.node[pos], d.pod[pos], d.leaf[pos], d.rail[pos]
    if np.all(node == node[0]):
        return None
    per_node = _counts(node)
    per_pod = _counts(pod)
    other_pod = per_pod < len(pos)
    in_pod_elsewhere = per_pod - per_node
    # Devices without a rail never share one; give each a unique rail key so they match nobody.
    rail_key = np.where(rail >= 0, rail.astype(np.int64), -1 - np.arange(len(pos)))
    same_rail_elsewhere = _counts(leaf, rail_key) - _counts(node, rail_key)
    worst = np.where(other_pod, LinkTier.CROSS_POD,
                     np.where(in_pod_elsewhere > same_rail_elsewhere, LinkTier.CROSS_RAIL, LinkTier.SAME_RAIL))
    nic_gb = np.minimum(d.nic_gbps[pos].astype(np.float64) / 8, graph.network.rail_bandwidth_gbps / 8)
    bandwidth = nic_gb / graph._tier_divisor[worst]
    return int(worst.max()), float(bandwidth.min()), float(graph._tier_latency[worst].max())
