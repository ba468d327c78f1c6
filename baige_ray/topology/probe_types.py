"""What a per-node hardware probe reports, and the pure rules shared by all probes.

The probes (NVML, `nvidia-smi topo -m`, sysfs) each fill part of a `NodeProbe`;
these dataclasses cross the Ray boundary (they pickle) and become a
`NodeProfile` for the ResourceGraph.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field


class PciDistance(enum.IntEnum):
    """nvidia-smi's PCIe closeness codes, nearest first."""

    PIX = 0  # at most one PCIe bridge
    PXB = 1  # several PCIe bridges, no host bridge
    PHB = 2  # through the PCIe host bridge (CPU root complex)
    NODE = 3  # across host bridges inside one NUMA node
    SYS = 4  # across the SMP interconnect between NUMA nodes (QPI/UPI)


@dataclass(kw_only=True, frozen=True)
class GpuInfo:
    index: int
    name: str
    memory_gb: float  # GB of 1e9 bytes, as the planner counts
    pci_bus_id: str = ""  # sysfs form, e.g. "0000:17:00.0"
    numa_node: int = -1


@dataclass(kw_only=True, frozen=True)
class HcaInfo:
    """An RDMA NIC: InfiniBand, or RoCE when its link layer is Ethernet."""

    name: str
    link_layer: str
    rate_gbps: float
    pci_bus_id: str = ""
    numa_node: int = -1
    netdev: str = ""
    active: bool = True


@dataclass(kw_only=True, frozen=True)
class NodeProbe:
    hostname: str
    num_cpus: int
    memory_gb: float  # GB of 1e9 bytes
    gpus: tuple[GpuInfo, ...] = ()
    islands: tuple[tuple[int, ...], ...] = ()  # GPU indices sharing NVLink directly
    hcas: tuple[HcaInfo, ...] = ()
    hca_of_gpu: tuple[str, ...] = ()  # the RDMA NIC each GPU sends through, "" for none
    source: str = "none"  # which probe found the GPUs: nvml, nvidia-smi or none
    notes: tuple[str, ...] = field(default=())

    @property
    def cpu_only(self) -> bool:
        return not self.gpus

    @property
    def rail_of_gpu(self) -> tuple[int, ...]:
        return rails_of(self.hca_of_gpu) if self.hca_of_gpu else (-1,) * len(self.gpus)


def normalize_bus_id(bus_id: str | bytes) -> str:
    """NVML writes 00000000:17:00.0, sysfs 0000:17:00.0; use the sysfs form, lower case."""
    if isinstance(bus_id, bytes):
        bus_id = bus_id.decode()
    bus_id = bus_id.strip().lower()
    domain, _, rest = bus_id.partition(":")
    if not rest:
        return bus_id
    return f"{int(domain, 16):04x}:{rest}"


def assign_rails(distance: Sequence[Sequence[int]], nic_names: Sequence[str]) -> tuple[int, ...]:
    """Rail of each GPU from a GPU x NIC PCIe distance table (-1 where no NIC)."""
    return rails_of(choose_nics(distance, nic_names))


def choose_nics(distance: Sequence[Sequence[int]], nic_names: Sequence[str]) -> tuple[str, ...]:
    """The NIC each GPU sends through ("" where there is none).

    Each GPU uses its nearest NICs. GPUs that tie on the same set of nearest NICs
    (two GPUs and two NICs under one PCIe switch, as on DGX A100) share them
    round-robin, as NCCL does.
    """
    chosen: list[str] = []
    seen_in_group: dict[tuple[str, ...], int] = {}
    for row in distance:
        best = min(row) if len(row) else None
        group = tuple(sorted((n for n, d in zip(nic_names, row) if d == best), key=_natural_key))
        if not group:
            chosen.append("")
            continue
        chosen.append(group[seen_in_group.get(group, 0) % len(group)])
        seen_in_group[group] = seen_in_group.get(group, 0) + 1
    return tuple(chosen)


def rails_of(chosen_nics: Sequence[str]) -> tuple[int, ...]:
    """Rails number the NICs that serve some GPU in name order, so storage NICs never take a
    rail number and rail i means the same thing on every node of the same type."""
    used = sorted({name for name in chosen_nics if name}, key=_natural_key)
    return tuple(used.index(name) if name else -1 for name in chosen_nics)


def clique_islands(num_gpus: int, linked: Sequence[Sequence[bool]]) -> tuple[tuple[int, ...], ...]:
    """Group GPUs into islands in which every pair is NVLink-connected (greedy, in index order)."""
    islands: list[list[int]] = []
    for gpu in range(num_gpus):
        for island in islands:
            if all(linked[gpu][member] for member in island):
                island.append(gpu)
                break
        else:
            islands.append([gpu])
    return tuple(tuple(island) for island in islands)


def _natural_key(name: str) -> tuple:
    """mlx5_10 sorts after mlx5_9."""
    head = name.rstrip("0123456789")
    tail = name[len(head):]
    return head, int(tail) if tail else -1
