"""The unified resource graph: every device, its node, island, rail, leaf and pod.

Pure Python + numpy, no Ray. Devices are columns of numpy arrays (see
`layout.DeviceArrays`), so the hierarchy device -> node (NVSwitch island) ->
rail / leaf -> spine -> pod is a set of coordinates per device. The link tier
and bandwidth between two devices follow from their coordinates in O(1); no
n x n matrix is ever built, which keeps 100,000 devices in a few megabytes.

Device ids and node ids are the ones of the full graph and survive
`without_devices` / `without_nodes`, so a planner working on a sub-graph can map
its choices straight back to the cluster.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from baige_ray.topology.descriptor import ClusterDescriptor, NetworkSpec
from baige_ray.topology.layout import DeviceArrays, NodeProfile, assemble_devices, profile_from_node_type

ArrayLike = int | Sequence[int] | np.ndarray


class LinkTier(enum.IntEnum):
    """Link classes, fastest first; a larger value is a slower, farther link."""

    NVLINK = 0  # same NVSwitch / NVLink island
    PCIE = 1  # same node, across PCIe / QPI
    SAME_RAIL = 2  # other node, same rail and leaf: one leaf-switch hop
    CROSS_RAIL = 3  # other node in the pod through the spine (other rail or other leaf group)
    CROSS_POD = 4  # other pod through the core


@dataclass(kw_only=True, frozen=True)
class LinkSummary:
    """The slowest link inside a device group (bandwidth in GB/s per direction)."""

    tier: LinkTier
    bandwidth_gb_per_s: float
    latency_us: float


@dataclass(kw_only=True, frozen=True)
class NodeTable:
    """Per-node columns, sorted by node id; `names` are host names or Ray node ids."""

    node_id: np.ndarray  # int32
    profile: np.ndarray  # int16
    names: tuple[str, ...]

    def take(self, index: np.ndarray) -> NodeTable:
        return NodeTable(
            node_id=self.node_id[index], profile=self.profile[index], names=tuple(self.names[i] for i in index)
        )


class ResourceGraph:
    """Devices, nodes and link tiers of one cluster. Build with `from_descriptor` or `from_profiles`."""

    def __init__(self, *, devices: DeviceArrays, nodes: NodeTable, profiles: Sequence[NodeProfile],
                 network: NetworkSpec, name: str = "cluster"):
        self.devices = devices
        self.nodes = nodes
        self.profiles = tuple(profiles)
        self.network = network
        self.name = name
        self._build_tier_tables()

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_descriptor(cls, descriptor: ClusterDescriptor, present: Mapping[int, str] | None = None) -> ResourceGraph:
        """The graph of a descriptor; `present` (node id -> node type name) limits or extends its nodes.

        Node ids fix each node's leaf and pod, so a live cluster that lacks node 3
        or gained node 9 keeps every other node where the network puts it.
        """
        profiles = {name: profile_from_node_type(node_type, descriptor.network)
                    for name, node_type in descriptor.node_types.items()}
        if present is None:
            node_ids: dict[str, np.ndarray] = {}
            start = 0
            for group in descriptor.nodes:
                ids = np.arange(start, start + group.count, dtype=np.int32)
                node_ids[group.type] = np.concatenate([node_ids.get(group.type, ids[:0]), ids])
                start += group.count
        else:
            unknown = sorted({name for name in present.values() if name not in profiles})
            if unknown:
                raise ValueError(f"present node types {unknown} are invalid: expected some of {sorted(profiles)}")
            node_ids = {name: np.array(sorted(i for i, t in present.items() if t == name), dtype=np.int32)
                        for name in profiles}
        return cls.from_profiles(profiles, node_ids, descriptor.network, name=descriptor.name)

    @classmethod
    def from_profiles(cls, profiles: dict[str, NodeProfile], node_ids: dict[str, np.ndarray | Sequence[int]],
                      network: NetworkSpec, *, name: str = "cluster",
                      node_names: dict[int, str] | None = None) -> ResourceGraph:
        """Place each named profile on its node ids (descriptor node types or probed nodes)."""
        keys = [key for key in profiles if len(node_ids.get(key, ())) > 0] or list(profiles)[:1]
        ordered = [profiles[key] for key in keys]
        id_arrays = [np.asarray(node_ids.get(key, ()), dtype=np.int32) for key in keys]
        devices = assemble_devices(ordered, id_arrays, network)
        all_ids = np.concatenate(id_arrays)
        order = np.argsort(all_ids, kind="stable")
        if len(np.unique(all_ids)) != len(all_ids):
            raise ValueError(f"node_ids={ {k: list(v) for k, v in node_ids.items()} !r} is invalid: "
                             "expected every node id under one profile only")
        profile_of = np.concatenate([np.full(len(ids), i, np.int16) for i, ids in enumerate(id_arrays)])
        names = node_names or {}
        nodes = NodeTable(node_id=all_ids[order], profile=profile_of[order],
                          names=tuple(names.get(int(i), f"node-{int(i)}") for i in all_ids[order]))
        return cls(devices=devices, nodes=nodes, profiles=ordered, network=network, name=name)

    def _build_tier_tables(self) -> None:
        profiles = self.profiles
        self._island_gb = np.array([p.island_gbps / 8 for p in profiles], dtype=np.float64)
        self._pcie_gb = np.array([p.pcie_gbps / 8 for p in profiles], dtype=np.float64)
        self._island_lat = np.array([p.island_latency_us for p in profiles], dtype=np.float64)
        self._pcie_lat = np.array([p.pcie_latency_us for p in profiles], dtype=np.float64)
        net = self.network
        # Bandwidth divisor per tier for traffic that leaves the node (same rail: full NIC rate).
        self._tier_divisor = np.array([1.0, 1.0, 1.0, net.oversubscription,
                                       net.oversubscription * net.cross_pod_oversubscription])
        self._tier_latency = np.array([0.0, 0.0, net.rail_latency_us, net.cross_rail_latency_us,
                                       net.cross_pod_latency_us])
        self._dense_ids = bool(len(self.devices) == 0 or self.devices.device_id[-1] == len(self.devices) - 1)

    # ---- sizes and lookups ----------------------------------------------------------------

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes.node_id)

    @property
    def device_ids(self) -> np.ndarray:
        return self.devices.device_id

    @property
    def node_ids(self) -> np.ndarray:
        return self.nodes.node_id

    def positions(self, device_ids: ArrayLike) -> np.ndarray:
        """Row positions of device ids; raises KeyError for ids not in this graph."""
        ids = np.asarray(device_ids, dtype=np.int64)
        if self._dense_ids:
            if ids.size and (ids.min() < 0 or ids.max() >= self.num_devices):
                raise KeyError(f"device ids {ids[(ids < 0) | (ids >= self.num_devices)][:5].tolist()} not in graph")
            return ids
        pos = np.searchsorted(self.devices.device_id, ids)
        pos = np.minimum(pos, max(self.num_devices - 1, 0))
        missing = self.devices.device_id[pos] != ids if self.num_devices else np.ones(ids.shape, bool)
        if np.any(missing):
            raise KeyError(f"device ids {np.atleast_1d(ids)[np.atleast_1d(missing)][:5].tolist()} not in graph")
        return pos

    def profile_of_node(self, node_id: int) -> NodeProfile:
        index = int(np.searchsorted(self.nodes.node_id, node_id))
        if index >= self.num_nodes or self.nodes.node_id[index] != node_id:
            raise KeyError(f"node {node_id} not in graph")
        return self.profiles[int(self.nodes.profile[index])]

    def devices_of_node(self, node_id: int) -> np.ndarray:
        lo, hi = np.searchsorted(self.devices.node, [node_id, node_id + 1])
        return self.devices.device_id[lo:hi]

    def cpu_only_nodes(self) -> np.ndarray:
        cpu_only = np.array([p.cpu_only for p in self.profiles], dtype=bool)
        return self.nodes.node_id[cpu_only[self.nodes.profile]] if len(cpu_only) else self.nodes.node_id[:0]

    # ---- hierarchy ------------------------------------------------------------------------

    def islands(self) -> list[np.ndarray]:
        """Device ids of each NVLink/NVSwitch island (a PCIe-only device is its own island)."""
        return _group_ids(self.devices.island, self.devices.device_id)

    def rails(self) -> dict[int, np.ndarray]:
        """Device ids served by each rail across the whole cluster (devices with no NIC left out)."""
        has_rail = self.devices.rail >= 0
        rails = self.devices.rail[has_rail]
        groups = _group_ids(rails, self.devices.device_id[has_rail])
        return {int(rail): ids for rail, ids in zip(np.unique(rails), groups)}

    def leaves(self) -> np.ndarray:
        return np.unique(self.devices.leaf)

    def pods(self) -> np.ndarray:
        return np.unique(self.devices.pod)

    # ---- links between devices ------------------------------------------------------------

    def tier_between(self, a: ArrayLike, b: ArrayLike) -> LinkTier | np.ndarray:
        """Link tier between devices a and b (element-wise for arrays; a device with itself is NVLINK)."""
        tiers = self._tiers(self.positions(a), self.positions(b))
        return LinkTier(int(tiers)) if np.ndim(tiers) == 0 else tiers

    def bandwidth_between(self, a: ArrayLike, b: ArrayLike) -> float | np.ndarray:
        """Point-to-point bandwidth in GB/s per direction (element-wise for arrays)."""
        pa, pb = self.positions(a), self.positions(b)
        bandwidth = self._bandwidth(pa, pb, self._tiers(pa, pb))
        return float(bandwidth) if np.ndim(bandwidth) == 0 else bandwidth

    def latency_between(self, a: ArrayLike, b: ArrayLike) -> float | np.ndarray:
        pa, pb = self.positions(a), self.positions(b)
        tiers = self._tiers(pa, pb)
        profile = self.devices.profile[pa]
        latency = np.where(tiers == LinkTier.NVLINK, self._island_lat[profile],
                           np.where(tiers == LinkTier.PCIE, self._pcie_lat[profile], self._tier_latency[tiers]))
        return float(latency) if np.ndim(latency) == 0 else latency

    def _tiers(self, pa: np.ndarray, pb: np.ndarray) -> np.ndarray:
        d = self.devices
        same_node = d.node[pa] == d.node[pb]
        same_island = d.island[pa] == d.island[pb]
        same_rail = (d.rail[pa] == d.rail[pb]) & (d.rail[pa] >= 0) & (d.leaf[pa] == d.leaf[pb])
        cross = np.where(d.pod[pa] != d.pod[pb], LinkTier.CROSS_POD,
                         np.where(same_rail, LinkTier.SAME_RAIL, LinkTier.CROSS_RAIL))
        return np.where(same_node, np.where(same_island, LinkTier.NVLINK, LinkTier.PCIE), cross).astype(np.int8)

    def _bandwidth(self, pa: np.ndarray, pb: np.ndarray, tiers: np.ndarray) -> np.ndarray:
        d = self.devices
        profile = d.profile[pa]
        nic_gb = np.minimum(d.nic_gbps[pa], d.nic_gbps[pb]).astype(np.float64) / 8
        rail_cap = self.network.rail_bandwidth_gbps / 8
        network = np.minimum(nic_gb, rail_cap) / self._tier_divisor[tiers]
        return np.where(tiers == LinkTier.NVLINK, self._island_gb[profile],
                        np.where(tiers == LinkTier.PCIE, self._pcie_gb[profile], network))

    # ---- groups -----------------------------------------------------------------------------

    # ---- sub-graphs ---------------------------------------------------------------------------

    def without_devices(self, device_ids: ArrayLike) -> ResourceGraph:
        """A copy without these devices; nodes stay (possibly empty), ids keep their values."""
        keep = np.ones(self.num_devices, dtype=bool)
        keep[self.positions(np.atleast_1d(device_ids))] = False
        return self._subset(np.flatnonzero(keep), np.arange(self.num_nodes))

    def without_nodes(self, node_ids: ArrayLike) -> ResourceGraph:
        """A copy without these nodes and their devices; unknown node ids raise KeyError."""
        drop = np.atleast_1d(np.asarray(node_ids, dtype=np.int64))
        unknown = np.setdiff1d(drop, self.nodes.node_id)
        if unknown.size:
            raise KeyError(f"nodes {unknown[:5].tolist()} not in graph")
        keep_devices = np.flatnonzero(~np.isin(self.devices.node, drop))
        keep_nodes = np.flatnonzero(~np.isin(self.nodes.node_id, drop))
        return self._subset(keep_devices, keep_nodes)

    def with_node_names(self, names: Mapping[int, str]) -> ResourceGraph:
        """The same graph with nodes renamed (e.g. to Ray node ids); unnamed nodes keep their names."""
        renamed = tuple(names.get(int(i), old) for i, old in zip(self.nodes.node_id, self.nodes.names))
        nodes = NodeTable(node_id=self.nodes.node_id, profile=self.nodes.profile, names=renamed)
        return ResourceGraph(devices=self.devices, nodes=nodes, profiles=self.profiles, network=self.network,
                             name=self.name)

    def _subset(self, device_rows: np.ndarray, node_rows: np.ndarray) -> ResourceGraph:
        return ResourceGraph(devices=self.devices.take(device_rows), nodes=self.nodes.take(node_rows),
                             profiles=self.profiles, network=self.network, name=self.name)

    def __repr__(self) -> str:
        return (f"ResourceGraph({self.name!r}, nodes={self.num_nodes}, devices={self.num_devices}, "
                f"islands={len(np.unique(self.devices.island))}, rails={len(self.rails())})")


def _group_ids(keys: np.ndarray, ids: np.ndarray) -> list[np.ndarray]:
    """Split `ids` by equal `keys`, groups in ascending key order."""
    if len(keys) == 0:
        return []
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    bounds = np.flatnonzero(sorted_keys[1:] != sorted_keys[:-1]) + 1
    return np.split(ids[order], bounds)
