"""Read RDMA NICs and PCIe placement from sysfs under a configurable root.

`root` is "/" on a real node and a temporary directory in tests, which build a
fake tree with the same layout:

    sys/class/infiniband/<hca>/device -> ../../../devices/pci0000:16/.../0000:18:00.0
    sys/class/infiniband/<hca>/ports/1/{rate,link_layer,state}
    sys/class/net/<ifname>/device -> the same PCI function (RoCE / IPoIB netdev)
    sys/bus/pci/devices/<bdf> -> ../../../devices/pci0000:16/.../<bdf>, with numa_node inside

PCIe closeness follows nvidia-smi's codes: two functions under one bridge are
PIX, under one switch PXB, under one root complex PHB, else NODE or SYS by NUMA.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from baige_ray.topology.probe_types import HcaInfo, PciDistance, normalize_bus_id

_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_RATE = re.compile(r"^\s*([\d.]+)\s*Gb/sec")


def read_hcas(root: str | Path = "/") -> tuple[HcaInfo, ...]:
    """Every RDMA device in /sys/class/infiniband, sorted by name; empty where there is none."""
    base = Path(root) / "sys/class/infiniband"
    if not base.is_dir():
        return ()
    netdevs = read_netdevs(root)
    hcas = []
    for entry in sorted(base.iterdir(), key=lambda p: p.name):
        port = _first_port(entry)
        bus_id = pci_bus_id_of(entry / "device")
        hcas.append(HcaInfo(
            name=entry.name,
            link_layer=_read(port / "link_layer", "InfiniBand") if port else "unknown",
            rate_gbps=_parse_rate(_read(port / "rate", "")) if port else 0.0,
            pci_bus_id=bus_id,
            numa_node=pci_numa_node(root, bus_id) if bus_id else -1,
            netdev=netdevs.get(bus_id, ""),
            active=("ACTIVE" in _read(port / "state", "")) if port else False,
        ))
    return tuple(hcas)


def read_netdevs(root: str | Path = "/") -> dict[str, str]:
    """PCI bus id -> network interface name for every netdev backed by a PCI function."""
    base = Path(root) / "sys/class/net"
    if not base.is_dir():
        return {}
    found = {}
    for entry in sorted(base.iterdir(), key=lambda p: p.name):
        bus_id = pci_bus_id_of(entry / "device")
        if bus_id and bus_id not in found:
            found[bus_id] = entry.name
    return found


def pci_bus_id_of(device_link: Path) -> str:
    """The PCI function a sysfs `device` link points at ("" when it is not a PCI device)."""
    if not device_link.exists():
        return ""
    name = Path(os.path.realpath(device_link)).name.lower()
    return name if _BDF.match(name) else ""


def pci_numa_node(root: str | Path, bus_id: str) -> int:
    value = _read(Path(root) / "sys/bus/pci/devices" / normalize_bus_id(bus_id) / "numa_node", "-1")
    try:
        return int(value)
    except ValueError:
        return -1


def pci_path(root: str | Path, bus_id: str) -> tuple[str, ...]:
    """Components from the root complex (pci0000:16) down to the function, or () if unknown."""
    link = Path(root) / "sys/bus/pci/devices" / normalize_bus_id(bus_id)
    if not link.exists():
        return ()
    parts = Path(os.path.realpath(link)).parts
    start = next((i for i, part in enumerate(parts) if part.startswith("pci")), None)
    return tuple(parts[start:]) if start is not None else ()


def pci_distance(root: str | Path, bus_a: str, bus_b: str) -> PciDistance:
    """How close two PCI functions are, in nvidia-smi's terms."""
    path_a, path_b = pci_path(root, bus_a), pci_path(root, bus_b)
    if not path_a or not path_b or path_a[0] != path_b[0]:
        numa_a, numa_b = pci_numa_node(root, bus_a), pci_numa_node(root, bus_b)
        return PciDistance.NODE if numa_a == numa_b and numa_a >= 0 else PciDistance.SYS
    common = 0
    for part_a, part_b in zip(path_a[:-1], path_b[:-1]):
        if part_a != part_b:
            break
        common += 1
    if common <= 2:
        # Only the root complex and at most its root port in common: traffic crosses the host bridge.
        return PciDistance.PHB
    return PciDistance.PIX if path_a[:-1] == path_b[:-1] else PciDistance.PXB


def hca_distance_table(root: str | Path, gpu_bus_ids: list[str], hcas: tuple[HcaInfo, ...]) -> list[list[int]]:
    """GPU x HCA table of PciDistance values, for `assign_rails`."""
    return [[int(pci_distance(root, gpu, hca.pci_bus_id)) if hca.pci_bus_id else int(PciDistance.SYS)
             for hca in hcas] for gpu in gpu_bus_ids]


def _first_port(hca_dir: Path) -> Path | None:
    ports = hca_dir / "ports"
    if not ports.is_dir():
        return None
    numbered = sorted((p for p in ports.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    return numbered[0] if numbered else None


def _parse_rate(text: str) -> float:
    """'200 Gb/sec (4X HDR)' -> 200.0."""
    match = _RATE.match(text)
    return float(match.group(1)) if match else 0.0


def _read(path: Path, default: str) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return default
