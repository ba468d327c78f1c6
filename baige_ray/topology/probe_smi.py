"""Parse `nvidia-smi topo -m` and `nvidia-smi --query-gpu` text: the fallback when NVML is missing.

Both layouts of the matrix are handled: newer drivers name NICs NIC0.. in the
header and map them in a "NIC Legend" (NIC0: mlx5_0); older ones put mlx5_0 in
the header directly. Cells are separated by tabs and may carry ANSI bold codes.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

from baige_ray.topology.probe_types import GpuInfo, PciDistance, clique_islands, normalize_bus_id

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_AFFINITY_COLUMNS = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
_LEGEND_LINE = re.compile(r"^\s*(NIC\d+)\s*:\s*(\S+)\s*$")
QUERY_FIELDS = "index,name,memory.total,pci.bus_id"


@dataclass(kw_only=True, frozen=True)
class TopoMatrix:
    gpus: tuple[str, ...]  # GPU0, GPU1, ...
    nics: tuple[str, ...]  # real NIC names (mlx5_0, ...), in column order
    links: dict[tuple[str, str], str]  # (row, column) -> X, NV18, PIX, PXB, PHB, NODE or SYS
    numa_of_gpu: tuple[int, ...]  # -1 when not reported

    def nvlink_count(self, a: str, b: str) -> int:
        cell = self.links.get((a, b), "")
        return int(cell[2:]) if cell.startswith("NV") and cell[2:].isdigit() else 0

    def islands(self) -> tuple[tuple[int, ...], ...]:
        linked = [[i == j or self.nvlink_count(a, b) > 0 for j, b in enumerate(self.gpus)]
                  for i, a in enumerate(self.gpus)]
        return clique_islands(len(self.gpus), linked)

    def nic_distance(self) -> list[list[int]]:
        """GPU x NIC table of PciDistance values (SYS where a cell is missing or unknown)."""
        return [[_distance(self.links.get((gpu, nic), "SYS")) for nic in self.nics] for gpu in self.gpus]


def parse_topo_matrix(text: str) -> TopoMatrix:
    lines = [_ANSI.sub("", line).rstrip("\n") for line in text.splitlines()]
    header_at = next((i for i, line in enumerate(lines) if _is_header(line)), None)
    if header_at is None:
        raise ValueError("nvidia-smi topo text is invalid: expected a header row starting with a tab and GPU0")
    columns = [cell.strip() for cell in lines[header_at].split("\t")[1:]]
    devices = [c for c in columns if c and c not in _AFFINITY_COLUMNS]
    legend = _nic_legend(lines)
    links: dict[tuple[str, str], str] = {}
    numa: dict[str, int] = {}
    for line in lines[header_at + 1:]:
        cells = [cell.strip() for cell in line.split("\t")]
        row = cells[0]
        if row not in devices:
            if row == "" or row.startswith("Legend"):
                break
            continue
        for column, cell in zip(columns, cells[1:]):
            if column in devices:
                links[(legend.get(row, row), legend.get(column, column))] = cell
            elif column == "NUMA Affinity" and cell.isdigit():
                numa[row] = int(cell)
    gpus = tuple(d for d in devices if d.startswith("GPU"))
    nics = tuple(legend.get(d, d) for d in devices if not d.startswith("GPU"))
    return TopoMatrix(gpus=gpus, nics=nics, links=links, numa_of_gpu=tuple(numa.get(g, -1) for g in gpus))


def parse_gpu_query(text: str) -> tuple[GpuInfo, ...]:
    """`nvidia-smi --query-gpu=index,name,memory.total,pci.bus_id --format=csv,noheader,nounits`."""
    gpus = []
    for line in text.strip().splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) != 4:
            raise ValueError(f"nvidia-smi query line={line!r} is invalid: expected {QUERY_FIELDS}")
        index, name, memory_mib, bus_id = fields
        gpus.append(GpuInfo(index=int(index), name=name, memory_gb=float(memory_mib) * 2**20 / 1e9,
                            pci_bus_id=normalize_bus_id(bus_id)))
    return tuple(gpus)


def run_nvidia_smi(*args: str, timeout_s: float = 20.0) -> str | None:
    """Output of nvidia-smi, or None where it is absent or fails (a CPU-only node)."""
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return None
    try:
        done = subprocess.run([binary, *args], capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _is_header(line: str) -> bool:
    cells = [cell.strip() for cell in line.split("\t")]
    return len(cells) > 1 and cells[0] == "" and "GPU0" in cells


def _nic_legend(lines: list[str]) -> dict[str, str]:
    legend = {}
    for line in lines:
        match = _LEGEND_LINE.match(line)
        if match:
            legend[match.group(1)] = match.group(2)
    return legend


def _distance(cell: str) -> int:
    try:
        return int(PciDistance[cell])
    except KeyError:
        return int(PciDistance.SYS)
