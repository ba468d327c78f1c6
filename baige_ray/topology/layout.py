"""Node profiles and the per-device arrays a ResourceGraph is made of.

A `NodeProfile` is everything the graph needs to know about one kind of node:
its chip, how its devices group into NVLink islands, which rail each device's
NIC serves and the intra-node bandwidths. Descriptor node types and probed
nodes both become profiles; `assemble_devices` then tiles a profile over many
node ids with numpy, which is what keeps a 100,000-device build well under a
second (no Python loop per device).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from baige_ray.api.validation import require_int, require_number
from baige_ray.topology.descriptor import NetworkSpec, NodeType

# Island ids are node_id * stride + local island; a node never has this many devices.
ISLAND_STRIDE = 1 << 12
NO_RAIL = -1


@dataclass(kw_only=True, frozen=True)
class NodeProfile:
    """One kind of node. Bandwidths in Gbit/s per direction (descriptor units)."""

    name: str
    accelerator: str
    chip_model: str
    device_memory_gb: float
    relative_speed: float
    peak_tflops: float
    fabric: str
    island_gbps: float
    island_latency_us: float
    pcie_gbps: float
    pcie_latency_us: float
    island_of_device: tuple[int, ...]
    rail_of_device: tuple[int, ...]
    nic_gbps_of_device: tuple[float, ...]
    numa_of_device: tuple[int, ...]
    num_cpus: int = 1
    host_memory_gb: float = 1.0

    def __post_init__(self) -> None:
        num = self.num_devices
        require_int(f"NodeProfile[{self.name}]", "num_devices", num, minimum=0)
        if num >= ISLAND_STRIDE:
            raise ValueError(f"NodeProfile[{self.name}].num_devices={num} is invalid: expected < {ISLAND_STRIDE}")
        for name in ("rail_of_device", "nic_gbps_of_device", "numa_of_device"):
            if len(getattr(self, name)) != num:
                raise ValueError(
                    f"NodeProfile[{self.name}].{name}={list(getattr(self, name))!r} is invalid: "
                    f"expected {num} entries, one per device"
                )
        for name in ("island_gbps", "pcie_gbps"):
            require_number(f"NodeProfile[{self.name}]", name, getattr(self, name), minimum=0, exclusive_minimum=True)

    @property
    def num_devices(self) -> int:
        return len(self.island_of_device)

    @property
    def cpu_only(self) -> bool:
        return self.num_devices == 0


def profile_from_node_type(node_type: NodeType, network: NetworkSpec) -> NodeProfile:
    fabric = node_type.intra_node
    num = node_type.num_devices
    rails = [NO_RAIL] * num
    # Devices behind no declared NIC still leave the node through the fabric at rail speed.
    nic_gbps = [network.rail_bandwidth_gbps] * num
    for nic in node_type.nics:
        for device in nic.devices:
            rails[device] = nic.rail
            nic_gbps[device] = nic.bandwidth_gbps
    switched = fabric.fabric in ("nvswitch", "nvlink")
    return NodeProfile(
        name=node_type.name,
        accelerator=node_type.accelerator,
        chip_model=node_type.chip.model,
        device_memory_gb=node_type.chip.memory_gb,
        relative_speed=node_type.chip.relative_speed,
        peak_tflops=node_type.chip.peak_tflops,
        fabric=fabric.fabric,
        island_gbps=fabric.bandwidth_gbps,
        island_latency_us=fabric.latency_us,
        # Without NVLink the fabric *is* PCIe, so its declared bandwidth is the PCIe one.
        pcie_gbps=fabric.pcie_bandwidth_gbps if switched else fabric.bandwidth_gbps,
        pcie_latency_us=fabric.pcie_latency_us if switched else fabric.latency_us,
        island_of_device=islands_for(fabric.fabric, num, fabric.islands),
        rail_of_device=tuple(rails),
        nic_gbps_of_device=tuple(float(g) for g in nic_gbps),
        numa_of_device=node_type.numa_of_devices(),
        num_cpus=node_type.num_cpus,
        host_memory_gb=node_type.memory_gb,
    )


def islands_for(fabric: str, num_devices: int, groups: Sequence[Sequence[int]] = ()) -> tuple[int, ...]:
    """Local island index per device: explicit NVLink groups, one switched island, or one per device."""
    if groups:
        island = [0] * num_devices
        for index, group in enumerate(groups):
            for device in group:
                island[device] = index
        return tuple(island)
    if fabric in ("nvswitch", "nvlink"):
        return (0,) * num_devices
    return tuple(range(num_devices))


@dataclass(kw_only=True)
class DeviceArrays:
    """Column store of devices, ordered by (node id, local index); index = position."""

    device_id: np.ndarray  # int64, original id, kept through sub-graphs
    node: np.ndarray  # int32, node id
    local: np.ndarray  # int16, index inside the node
    profile: np.ndarray  # int16, index into the profile table
    island: np.ndarray  # int64, global island id
    rail: np.ndarray  # int16, rail of the serving NIC or NO_RAIL
    leaf: np.ndarray  # int32, leaf group (node id // nodes_per_leaf)
    pod: np.ndarray  # int32
    nic_gbps: np.ndarray  # float32
    numa: np.ndarray  # int16
    memory_gb: np.ndarray  # float32
    speed: np.ndarray  # float32

    def take(self, index: np.ndarray) -> DeviceArrays:
        return DeviceArrays(**{name: getattr(self, name)[index] for name in self.__dataclass_fields__})

    def __len__(self) -> int:
        return len(self.device_id)


def assemble_devices(
    profiles: Sequence[NodeProfile], node_ids_per_profile: Sequence[np.ndarray], network: NetworkSpec
) -> DeviceArrays:
    """Tile each profile over its node ids and sort the result by (node, local index)."""
    parts = [_tile(pid, profile, np.asarray(ids, dtype=np.int32)) for pid, (profile, ids) in
             enumerate(zip(profiles, node_ids_per_profile))]
    columns = {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}
    order = np.lexsort((columns["local"], columns["node"]))
    if not np.array_equal(order, np.arange(len(order))):
        columns = {name: values[order] for name, values in columns.items()}
    node = columns["node"]
    leaf = (node // network.nodes_per_leaf).astype(np.int32)
    memory = np.array([p.device_memory_gb for p in profiles], dtype=np.float32)
    speed = np.array([p.relative_speed for p in profiles], dtype=np.float32)
    return DeviceArrays(
        device_id=np.arange(len(node), dtype=np.int64),
        leaf=leaf,
        pod=(leaf // network.leaves_per_pod).astype(np.int32),
        memory_gb=memory[columns["profile"]],
        speed=speed[columns["profile"]],
        **columns,
    )


def _tile(profile_id: int, profile: NodeProfile, node_ids: np.ndarray) -> dict[str, np.ndarray]:
    per_node = profile.num_devices
    node = np.repeat(node_ids, per_node)
    return {
        "node": node,
        "local": np.tile(np.arange(per_node, dtype=np.int16), len(node_ids)),
        "profile": np.full(len(node), profile_id, dtype=np.int16),
        "island": node.astype(np.int64) * ISLAND_STRIDE + np.tile(np.array(profile.island_of_device, np.int64),
                                                                  len(node_ids)),
        "rail": np.tile(np.array(profile.rail_of_device, dtype=np.int16), len(node_ids)),
        "nic_gbps": np.tile(np.array(profile.nic_gbps_of_device, dtype=np.float32), len(node_ids)),
        "numa": np.tile(np.array(profile.numa_of_device, dtype=np.int16), len(node_ids)),
    }
