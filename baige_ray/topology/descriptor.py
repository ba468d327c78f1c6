"""Hardware descriptors: YAML files (those in clusters/ ship by name) that describe a cluster when no hardware
can be probed.

A descriptor names node types (devices per node, chip, intra-node fabric, NICs
and the rail each serves) and how many nodes of each type exist, plus the
network above the nodes. Loading validates every field with a clear error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from baige_ray.accelerator import AcceleratorKind
from baige_ray.api.validation import require_choice, require_int, require_number
from baige_ray.catalog import cluster_descriptor, cluster_names

FABRICS = ("nvswitch", "nvlink", "pcie", "none")


@dataclass(kw_only=True, frozen=True)
class ChipSpec:
    model: str
    memory_gb: float
    relative_speed: float = 1.0
    peak_tflops: float = 100.0

    def __post_init__(self) -> None:
        _require_name("ChipSpec", "model", self.model)
        require_number("ChipSpec", "memory_gb", self.memory_gb, minimum=0, exclusive_minimum=True)
        require_number("ChipSpec", "relative_speed", self.relative_speed, minimum=0, exclusive_minimum=True)
        require_number("ChipSpec", "peak_tflops", self.peak_tflops, minimum=0, exclusive_minimum=True)


@dataclass(kw_only=True, frozen=True)
class IntraNodeFabric:
    """How devices inside one node talk. Bandwidths are per direction, in Gbit/s.

    `islands` lists groups of device indices that share NVLink directly (for
    `fabric: nvlink` without a switch); empty means the whole node is one island
    for nvswitch/nvlink and every device is its own island for pcie/none.
    """

    fabric: str
    bandwidth_gbps: float
    latency_us: float = 2.0
    pcie_bandwidth_gbps: float = 256.0
    pcie_latency_us: float = 4.0
    islands: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        require_choice("IntraNodeFabric", "fabric", self.fabric, FABRICS)
        require_number("IntraNodeFabric", "bandwidth_gbps", self.bandwidth_gbps, minimum=0, exclusive_minimum=True)
        require_number("IntraNodeFabric", "latency_us", self.latency_us, minimum=0)
        require_number(
            "IntraNodeFabric", "pcie_bandwidth_gbps", self.pcie_bandwidth_gbps, minimum=0, exclusive_minimum=True
        )
        require_number("IntraNodeFabric", "pcie_latency_us", self.pcie_latency_us, minimum=0)
        object.__setattr__(self, "islands", tuple(tuple(island) for island in self.islands))
        if self.islands and self.fabric != "nvlink":
            raise ValueError(
                f"IntraNodeFabric.islands={[list(i) for i in self.islands]!r} is invalid: "
                f"expected islands only with fabric 'nvlink', got fabric {self.fabric!r}"
            )


@dataclass(kw_only=True, frozen=True)
class NicSpec:
    name: str
    bandwidth_gbps: float
    rail: int
    devices: tuple[int, ...]
    numa_node: int = 0

    def __post_init__(self) -> None:
        _require_name("NicSpec", "name", self.name)
        require_number("NicSpec", "bandwidth_gbps", self.bandwidth_gbps, minimum=0, exclusive_minimum=True)
        require_int("NicSpec", "rail", self.rail, minimum=0)
        require_int("NicSpec", "numa_node", self.numa_node, minimum=0)
        object.__setattr__(self, "devices", tuple(self.devices))


@dataclass(kw_only=True, frozen=True)
class NodeType:
    name: str
    accelerator: str
    num_devices: int
    chip: ChipSpec
    intra_node: IntraNodeFabric
    num_cpus: int = 8
    memory_gb: float = 64.0
    nics: tuple[NicSpec, ...] = ()
    device_numa: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _require_name("NodeType", "name", self.name)
        require_choice(f"NodeType[{self.name}]", "accelerator", self.accelerator, [k.value for k in AcceleratorKind])
        require_int(f"NodeType[{self.name}]", "num_devices", self.num_devices, minimum=1)
        require_int(f"NodeType[{self.name}]", "num_cpus", self.num_cpus, minimum=1)
        require_number(f"NodeType[{self.name}]", "memory_gb", self.memory_gb, minimum=0, exclusive_minimum=True)
        for nic in self.nics:
            _require_device_indices(f"NodeType[{self.name}].nics[{nic.name}]", "devices", nic.devices, self.num_devices)
        _require_partition(f"NodeType[{self.name}].intra_node", "islands", self.intra_node.islands, self.num_devices)
        _require_partition(
            f"NodeType[{self.name}]", "nics", [nic.devices for nic in self.nics], self.num_devices, complete=False
        )
        object.__setattr__(self, "device_numa", tuple(self.device_numa))
        if self.device_numa and len(self.device_numa) != self.num_devices:
            raise ValueError(
                f"NodeType[{self.name}].device_numa={list(self.device_numa)!r} is invalid: "
                f"expected one NUMA node per device ({self.num_devices} entries) or none"
            )
        for numa in self.device_numa:
            require_int(f"NodeType[{self.name}]", "device_numa[]", numa, minimum=0)

    def numa_of_devices(self) -> tuple[int, ...]:
        """NUMA node per device: declared, else the NUMA node of the NIC serving it, else 0."""
        if self.device_numa:
            return self.device_numa
        numa = [0] * self.num_devices
        for nic in self.nics:
            for device in nic.devices:
                numa[device] = nic.numa_node
        return tuple(numa)


@dataclass(kw_only=True, frozen=True)
class NodeGroup:
    type: str
    count: int

    def __post_init__(self) -> None:
        require_int("NodeGroup", "count", self.count, minimum=1)


@dataclass(kw_only=True, frozen=True)
class NetworkSpec:
    """The fabric above the nodes, rail-optimized: each rail of `nodes_per_leaf`
    consecutive nodes meets on one leaf switch; `leaves_per_pod` such leaf groups
    share a spine layer (a pod); pods meet at the core. Bandwidth in Gbit/s."""

    nodes_per_leaf: int = 32
    leaves_per_pod: int = 8
    rail_bandwidth_gbps: float = 200.0
    rail_latency_us: float = 5.0
    cross_rail_latency_us: float = 8.0
    cross_pod_latency_us: float = 12.0
    oversubscription: float = 1.0
    cross_pod_oversubscription: float = 1.0

    def __post_init__(self) -> None:
        require_int("NetworkSpec", "nodes_per_leaf", self.nodes_per_leaf, minimum=1)
        require_int("NetworkSpec", "leaves_per_pod", self.leaves_per_pod, minimum=1)
        require_number("NetworkSpec", "rail_bandwidth_gbps", self.rail_bandwidth_gbps, minimum=0, exclusive_minimum=True)
        for name in ("rail_latency_us", "cross_rail_latency_us", "cross_pod_latency_us"):
            require_number("NetworkSpec", name, getattr(self, name), minimum=0)
        require_number("NetworkSpec", "oversubscription", self.oversubscription, minimum=1.0)
        require_number("NetworkSpec", "cross_pod_oversubscription", self.cross_pod_oversubscription, minimum=1.0)


@dataclass(kw_only=True, frozen=True)
class ClusterDescriptor:
    name: str
    node_types: dict[str, NodeType]
    nodes: tuple[NodeGroup, ...]
    network: NetworkSpec = field(default_factory=NetworkSpec)

    def __post_init__(self) -> None:
        _require_name("ClusterDescriptor", "name", self.name)
        if not self.nodes:
            raise ValueError("ClusterDescriptor.nodes=[] is invalid: expected at least one node group")
        for group in self.nodes:
            require_choice("NodeGroup", "type", group.type, sorted(self.node_types))

    def node_type_sequence(self) -> list[NodeType]:
        """The node type of every node, in descriptor order (node index -> type)."""
        return [self.node_types[group.type] for group in self.nodes for _ in range(group.count)]

    @property
    def num_nodes(self) -> int:
        return sum(group.count for group in self.nodes)

    @property
    def num_devices(self) -> int:
        return sum(node.num_devices for node in self.node_type_sequence())


def _require_name(owner: str, field_name: str, value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{owner}.{field_name}={value!r} is invalid: expected a non-empty string")


def _require_device_indices(owner: str, field_name: str, devices: Any, num_devices: int) -> None:
    bad = [d for d in devices if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < num_devices]
    if bad:
        raise ValueError(
            f"{owner}.{field_name}={list(devices)!r} is invalid: expected device indices in [0, {num_devices})"
        )


def _require_partition(owner: str, field_name: str, groups: Any, num_devices: int, *, complete: bool = True) -> None:
    """Groups of device indices must not overlap; islands must also cover every device."""
    seen: list[int] = []
    for group in groups:
        _require_device_indices(owner, field_name, group, num_devices)
        seen.extend(group)
    duplicates = sorted({d for d in seen if seen.count(d) > 1})
    if duplicates:
        raise ValueError(
            f"{owner}.{field_name}={[list(g) for g in groups]!r} is invalid: "
            f"expected each device in at most one group, devices {duplicates} repeat"
        )
    if complete and groups and sorted(seen) != list(range(num_devices)):
        raise ValueError(
            f"{owner}.{field_name}={[list(g) for g in groups]!r} is invalid: "
            f"expected groups covering every device 0..{num_devices - 1}"
        )


def _build(cls: type, data: Any, where: str, **overrides: Any) -> Any:
    if not isinstance(data, dict):
        raise ValueError(f"{where}={data!r} is invalid: expected a mapping")
    known = set(cls.__dataclass_fields__)
    unknown = sorted(set(data) - known - set(overrides))
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}: expected some of {sorted(known)}")
    try:
        return cls(**{**data, **overrides})
    except TypeError as error:
        raise ValueError(f"{where} is incomplete: {error}") from None


def descriptor_from_dict(data: Any) -> ClusterDescriptor:
    if not isinstance(data, dict):
        raise ValueError(f"cluster descriptor={data!r} is invalid: expected a mapping")
    node_types = {}
    for name, spec in (data.get("node_types") or {}).items():
        where = f"node_types.{name}"
        if not isinstance(spec, dict):
            raise ValueError(f"{where}={spec!r} is invalid: expected a mapping")
        node_types[name] = _build(
            NodeType,
            spec,
            where,
            name=name,
            chip=_build(ChipSpec, spec.get("chip"), f"{where}.chip"),
            intra_node=_build(IntraNodeFabric, spec.get("intra_node"), f"{where}.intra_node"),
            nics=tuple(_build(NicSpec, nic, f"{where}.nics[{i}]") for i, nic in enumerate(spec.get("nics") or [])),
        )
    nodes = tuple(_build(NodeGroup, group, f"nodes[{i}]") for i, group in enumerate(data.get("nodes") or []))
    network = _build(NetworkSpec, data.get("network") or {}, "network")
    return _build(
        ClusterDescriptor, data, "cluster descriptor", node_types=node_types, nodes=nodes, network=network
    )


def load_descriptor(reference: str | Path) -> ClusterDescriptor:
    """A descriptor by name (`"sim-2x4"`, one that ships with baige-ray: catalog.cluster_names()) or by path."""
    path = cluster_descriptor(reference)
    if not path.is_file():
        raise ValueError(f"cluster descriptor path={str(path)!r} is invalid: expected an existing YAML file, "
                         f"or the name of one that ships ({', '.join(cluster_names())})")
    with path.open() as handle:
        return descriptor_from_dict(yaml.safe_load(handle))
