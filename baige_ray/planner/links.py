"""The slowest link each communication group of a layout spans, for all its groups at once.

A collective is priced on the slowest tier any pair of its members spans (the
ring or tree NCCL builds is only as fast as its slowest hop). Groups of a layout
are rows of a (num_groups, group_size) array of graph row positions; every
question is answered with numpy over all rows, so a 100,000-device layout costs
a few array passes, not 100,000 Python calls. The tier rules are those of
`ResourceGraph.slowest_link`, rebuilt here from the graph's public attributes
(profiles and network spec) because the topology package is owned elsewhere:
  * members on one node: NVLINK, or PCIE when the node's members span islands;
  * members on several nodes: CROSS_POD if pods differ, else CROSS_RAIL if any
    two sit on different (leaf, rail) pairs, else SAME_RAIL;
  * bandwidth: the slower of the worst intra-node pair and min NIC rate (capped
    by the rail) divided by the tier's oversubscription.
With a calibration, a tier it measured is priced with the measured latency and bandwidth
instead (the group's worst tier decides, as above).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from baige_ray.topology.graph import LinkTier, ResourceGraph

if TYPE_CHECKING:
    from baige_ray.planner.calibration import Calibration


@dataclass(kw_only=True, frozen=True)
class GroupLink:
    """Worst link over all groups of one dimension; bandwidth in bytes/s, latency in seconds."""

    tier: int
    bandwidth: float
    latency: float
    # Measured per collective kind: ((kind, bandwidth, latency), ...); other kinds use the two above.
    kinds: tuple[tuple[str, float, float], ...] = ()

    def for_kind(self, kind: str) -> tuple[float, float]:
        """(bandwidth, latency) of one collective kind over this link."""
        for name, bandwidth, latency in self.kinds:
            if name == kind:
                return bandwidth, latency
        return self.bandwidth, self.latency

    @property
    def tier_name(self) -> str:
        return LinkTier(self.tier).name if self.tier >= 0 else "NONE"


# A dimension of size 1 communicates with nobody.
NO_LINK = GroupLink(tier=-1, bandwidth=float("inf"), latency=0.0)


class LinkTables:
    """Per-device coordinates and per-tier constants of one graph, gathered once."""

    def __init__(self, graph: ResourceGraph, calibration: Calibration | None = None):
        d, net = graph.devices, graph.network
        self.measured = {tier: (fit.bandwidth, fit.latency_s,
                                tuple((kind, k.bandwidth, k.latency_s) for kind, k in sorted(fit.kinds.items())))
                         for tier, fit in (calibration.links.items() if calibration is not None else ())}
        self.node, self.island, self.pod = d.node, d.island, d.pod
        no_rail = -1 - np.arange(len(d.rail), dtype=np.int64)  # a device without a rail matches nobody
        self.rail_key = np.where(d.rail >= 0, d.leaf.astype(np.int64) * 4096 + d.rail, no_rail)
        self.nic = np.minimum(d.nic_gbps.astype(np.float64), net.rail_bandwidth_gbps) * (1e9 / 8)
        profile = d.profile
        self.island_bw = np.array([p.island_gbps for p in graph.profiles])[profile] * (1e9 / 8)
        self.pcie_bw = np.array([p.pcie_gbps for p in graph.profiles])[profile] * (1e9 / 8)
        self.island_lat = np.array([p.island_latency_us for p in graph.profiles])[profile] * 1e-6
        self.pcie_lat = np.array([p.pcie_latency_us for p in graph.profiles])[profile] * 1e-6
        self.peak_flops = np.array([p.peak_tflops for p in graph.profiles])[profile] * 1e12
        self.memory_bytes = d.memory_gb.astype(np.float64) * 1e9
        self.divisor = np.array([1.0, 1.0, 1.0, net.oversubscription,
                                 net.oversubscription * net.cross_pod_oversubscription])
        self.tier_latency = np.array([0.0, 0.0, net.rail_latency_us, net.cross_rail_latency_us,
                                      net.cross_pod_latency_us]) * 1e-6


def group_link(tables: LinkTables, groups: np.ndarray) -> GroupLink:
    """Worst tier / bandwidth / latency over every row of `groups` (graph row positions)."""
    if groups.shape[1] < 2 or groups.size == 0:
        return NO_LINK
    pos = np.sort(groups, axis=1)  # graph rows are node-major, so a node's members become adjacent
    node = tables.node[pos]
    adjacent_same_node = node[:, 1:] == node[:, :-1]
    island = tables.island[pos]
    split = adjacent_same_node & (island[:, 1:] != island[:, :-1])
    left = pos[:, :-1]
    intra_bw = np.where(split, tables.pcie_bw[left], tables.island_bw[left])
    intra_lat = np.where(split, tables.pcie_lat[left], tables.island_lat[left])
    tier = np.where(split.any(), LinkTier.PCIE, LinkTier.NVLINK) if adjacent_same_node.any() else -1
    bandwidth = float(intra_bw[adjacent_same_node].min()) if adjacent_same_node.any() else np.inf
    latency = float(intra_lat[adjacent_same_node].max()) if adjacent_same_node.any() else 0.0
    multi_node = node[:, 0] != node[:, -1]
    if multi_node.any():
        cross_tier, cross_bw, cross_lat = _cross_node(tables, pos[multi_node])
        tier, bandwidth, latency = max(tier, cross_tier), min(bandwidth, cross_bw), max(latency, cross_lat)
    return with_measured(tables, GroupLink(tier=int(tier), bandwidth=float(bandwidth), latency=float(latency)))


def with_measured(tables: LinkTables, link: GroupLink) -> GroupLink:
    """The link priced with its tier's measured figures where calibration has them."""
    if link.tier not in tables.measured:
        return link
    bandwidth, latency, kinds = tables.measured[link.tier]
    return GroupLink(tier=link.tier, bandwidth=float(bandwidth), latency=float(latency), kinds=kinds)


def _cross_node(tables: LinkTables, pos: np.ndarray) -> tuple[int, float, float]:
    pod = tables.pod[pos]
    rail_key = tables.rail_key[pos]
    pods_differ = (pod != pod[:, :1]).any(axis=1)
    rails_differ = (rail_key != rail_key[:, :1]).any(axis=1)
    tier = np.where(pods_differ, LinkTier.CROSS_POD, np.where(rails_differ, LinkTier.CROSS_RAIL, LinkTier.SAME_RAIL))
    bandwidth = tables.nic[pos].min(axis=1) / tables.divisor[tier]
    return int(tier.max()), float(bandwidth.min()), float(tables.tier_latency[tier].max())


def neighbour_link(tables: LinkTables, chains: np.ndarray) -> GroupLink:
    """Worst link between consecutive members of each row (pipeline stage i -> i + 1)."""
    if chains.shape[1] < 2 or chains.size == 0:
        return NO_LINK
    pairs = np.stack([chains[:, :-1].ravel(), chains[:, 1:].ravel()], axis=1)
    return group_link(tables, pairs)


def probe_groups(graph: ResourceGraph, positions: np.ndarray) -> dict[int, list[list[int]]]:
    """Per link tier the cluster has, rank groups whose slowest link is that tier: the smallest
    (a pair) and the largest such group, so the fit sees latency and bandwidth at two sizes.
    `positions[rank]` is the rank's device row in `graph`."""
    tables = LinkTables(graph)
    ranks = np.arange(len(positions))
    candidates = [ranks]
    for key in (tables.node, tables.rail_key, tables.island):
        values = key[positions]
        candidates += [ranks[values == value] for value in np.unique(values)]
    candidates += [np.array([0, other]) for other in ranks[1:]]
    by_tier: dict[int, list[np.ndarray]] = {}
    for group in candidates:
        if len(group) >= 2:
            tier = group_link(tables, positions[group][None, :]).tier
            by_tier.setdefault(int(tier), []).append(group)
    chosen = {}
    for tier, groups in sorted(by_tier.items()):
        smallest, largest = min(groups, key=len), max(groups, key=len)
        chosen[tier] = [smallest.tolist()] + ([largest.tolist()] if len(largest) > len(smallest) else [])
    return chosen


def tier_pairs(graph: ResourceGraph, positions: np.ndarray, tier: int) -> list[list[int]]:
    """Disjoint rank pairs whose link is exactly `tier`, as many as the ranks allow (greedy, in rank
    order): the pattern of a layout's size-2 groups all communicating at once."""
    tables = LinkTables(graph)
    free = list(range(len(positions)))
    pairs = []
    while free:
        first = free.pop(0)
        partner = next((r for r in free if group_link(tables, positions[[first, r]][None, :]).tier == tier), None)
        if partner is not None:
            free.remove(partner)
            pairs.append([first, partner])
    return pairs


def expert_link_key(ep: int, cp: int = 1) -> str:
    """The `layout_links` key of expert-parallel groups of `ep` ranks in a layout with `cp` context-parallel
    ranks per replica: with CP, an expert group's ranks are `cp` replicas apart (planner/mapping.py)."""
    return f"ep{ep}" if ep == 1 or cp == 1 else f"ep{ep}/cp{cp}"
