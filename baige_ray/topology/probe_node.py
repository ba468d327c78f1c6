"""Probe one node (NVML, else `nvidia-smi`, plus sysfs) and turn the result into a NodeProfile.

`probe_node` runs on the node being probed (the TopologyActor sends it there as
a Ray task pinned to that node). Every source is optional: a node with neither
NVML nor nvidia-smi is reported as CPU-only, and a node without RDMA NICs gets
no rails.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from baige_ray.topology.descriptor import NetworkSpec
from baige_ray.topology.layout import NodeProfile, islands_for
from baige_ray.topology.probe_nvml import probe_nvml
from baige_ray.topology.probe_smi import QUERY_FIELDS, parse_gpu_query, parse_topo_matrix, run_nvidia_smi
from baige_ray.topology.probe_sysfs import hca_distance_table, pci_numa_node, read_hcas
from baige_ray.topology.probe_types import GpuInfo, NodeProbe, choose_nics


@dataclass(kw_only=True, frozen=True)
class ChipFacts:
    """Public figures for a chip family: relative training speed (A100 = 1), BF16 dense TFLOPS,
    NVLink bandwidth per direction in Gbit/s (0 where the part has no NVLink)."""

    relative_speed: float
    peak_tflops: float
    nvlink_gbps: float


# Matched by substring of the NVML / nvidia-smi name, first match wins (so "H100" before "A100").
CHIP_FACTS: tuple[tuple[str, ChipFacts], ...] = (
    ("B200", ChipFacts(relative_speed=6.0, peak_tflops=2250, nvlink_gbps=7200)),
    ("H200", ChipFacts(relative_speed=3.3, peak_tflops=989, nvlink_gbps=3600)),
    ("H100", ChipFacts(relative_speed=3.0, peak_tflops=989, nvlink_gbps=3600)),
    ("A100", ChipFacts(relative_speed=1.0, peak_tflops=312, nvlink_gbps=2400)),
    ("L40S", ChipFacts(relative_speed=0.9, peak_tflops=362, nvlink_gbps=0)),
    ("A6000", ChipFacts(relative_speed=0.5, peak_tflops=155, nvlink_gbps=448)),
    ("V100", ChipFacts(relative_speed=0.4, peak_tflops=125, nvlink_gbps=1200)),
    ("L4", ChipFacts(relative_speed=0.3, peak_tflops=121, nvlink_gbps=0)),
    ("T4", ChipFacts(relative_speed=0.2, peak_tflops=65, nvlink_gbps=0)),
)
UNKNOWN_CHIP = ChipFacts(relative_speed=1.0, peak_tflops=100, nvlink_gbps=800)
PCIE_GBPS = 256.0  # PCIe Gen4 x16 per direction; the common floor for GPU-to-GPU without NVLink


def chip_facts(name: str) -> ChipFacts:
    upper = name.upper()
    return next((facts for key, facts in CHIP_FACTS if key in upper), UNKNOWN_CHIP)


def probe_node(sys_root: str | Path = "/", *, nvml: Any = None,
               smi: Callable[..., str | None] = run_nvidia_smi) -> NodeProbe:
    """Everything this node can tell about its GPUs, NVLink islands, RDMA NICs and rails."""
    notes: list[str] = []
    found = probe_nvml(nvml)
    source = "nvml"
    if found is None:
        found, source = _probe_smi(smi), "nvidia-smi"
    if found is None:
        found, source = ((), ()), "none"
        notes.append("no NVML and no nvidia-smi: CPU-only node")
    gpus, islands = found
    gpus = tuple(_with_numa(sys_root, gpu) for gpu in gpus)
    hcas = tuple(h for h in read_hcas(sys_root) if h.active)
    chosen = _choose_hcas(sys_root, gpus, hcas)
    return NodeProbe(
        hostname=socket.gethostname(), num_cpus=os.cpu_count() or 1, memory_gb=_host_memory_gb(),
        gpus=gpus, islands=islands, hcas=hcas, hca_of_gpu=chosen, source=source, notes=tuple(notes),
    )


def _probe_smi(smi: Callable[..., str | None]) -> tuple[tuple[GpuInfo, ...], tuple[tuple[int, ...], ...]] | None:
    query = smi(f"--query-gpu={QUERY_FIELDS}", "--format=csv,noheader,nounits")
    if not query:
        return None
    gpus = parse_gpu_query(query)
    topo = smi("topo", "-m")
    if not topo:
        return gpus, islands_to_tuples(islands_for("pcie", len(gpus)))
    matrix = parse_topo_matrix(topo)
    numa = dict(zip(range(len(matrix.gpus)), matrix.numa_of_gpu))
    gpus = tuple(GpuInfo(index=g.index, name=g.name, memory_gb=g.memory_gb, pci_bus_id=g.pci_bus_id,
                         numa_node=numa.get(g.index, -1)) for g in gpus)
    return gpus, matrix.islands()


def islands_to_tuples(island_of_device: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    groups: dict[int, list[int]] = {}
    for device, island in enumerate(island_of_device):
        groups.setdefault(island, []).append(device)
    return tuple(tuple(g) for g in groups.values())


def _with_numa(sys_root: str | Path, gpu: GpuInfo) -> GpuInfo:
    if gpu.numa_node >= 0 or not gpu.pci_bus_id:
        return gpu
    return GpuInfo(index=gpu.index, name=gpu.name, memory_gb=gpu.memory_gb, pci_bus_id=gpu.pci_bus_id,
                   numa_node=pci_numa_node(sys_root, gpu.pci_bus_id))


def _choose_hcas(sys_root: str | Path, gpus: tuple[GpuInfo, ...], hcas: tuple) -> tuple[str, ...]:
    if not gpus or not hcas:
        return ("",) * len(gpus)
    table = hca_distance_table(sys_root, [g.pci_bus_id for g in gpus], hcas)
    return choose_nics(table, [h.name for h in hcas])


def _host_memory_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError):
        return 1.0


def profile_from_probe(probe: NodeProbe, network: NetworkSpec, name: str = "") -> NodeProfile:
    """A NodeProfile for one probed node; chip speed and NVLink rate come from CHIP_FACTS."""
    name = name or probe.hostname
    first = probe.gpus[0] if probe.gpus else None
    facts = chip_facts(first.name) if first else UNKNOWN_CHIP
    island_of = [0] * len(probe.gpus)
    for index, island in enumerate(probe.islands):
        for gpu in island:
            island_of[gpu] = index
    linked = any(len(island) > 1 for island in probe.islands) and facts.nvlink_gbps > 0
    rate_of_hca = {h.name: h.rate_gbps for h in probe.hcas if h.rate_gbps > 0}
    hca_of_gpu = probe.hca_of_gpu or ("",) * len(probe.gpus)
    # A GPU with no RDMA NIC near it still leaves the node, at the network's nominal rail rate.
    nic_gbps = [rate_of_hca.get(hca, network.rail_bandwidth_gbps) for hca in hca_of_gpu]
    return NodeProfile(
        name=name,
        accelerator="cuda" if probe.gpus else "cpu",
        chip_model=first.name if first else "cpu",
        device_memory_gb=round(first.memory_gb, 1) if first else 0.0,
        relative_speed=facts.relative_speed,
        peak_tflops=facts.peak_tflops,
        fabric=("nvswitch" if len(probe.islands) == 1 and len(probe.gpus) > 2 else "nvlink") if linked else "pcie",
        island_gbps=facts.nvlink_gbps if linked else PCIE_GBPS,
        island_latency_us=2.0 if linked else 4.0,
        pcie_gbps=PCIE_GBPS,
        pcie_latency_us=4.0,
        island_of_device=tuple(island_of),
        rail_of_device=probe.rail_of_gpu,
        nic_gbps_of_device=tuple(float(g) for g in nic_gbps),
        numa_of_device=tuple(max(g.numa_node, 0) for g in probe.gpus),
        num_cpus=probe.num_cpus,
        host_memory_gb=probe.memory_gb,
    )
