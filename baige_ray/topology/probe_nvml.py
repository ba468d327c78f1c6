"""Read GPUs and NVLink peers through NVML (nvidia-ml-py), when a driver is present.

The NVML module is a parameter so tests can hand in a fake with the same
functions; on a node without the library or the driver, `probe_nvml` returns
None and the caller falls back to `nvidia-smi` text.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from baige_ray.topology.probe_types import GpuInfo, clique_islands, normalize_bus_id


def load_nvml() -> ModuleType | None:
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def probe_nvml(nvml: Any = None) -> tuple[tuple[GpuInfo, ...], tuple[tuple[int, ...], ...]] | None:
    """(GPUs, NVLink islands), or None where NVML cannot start (no library, no driver)."""
    nvml = nvml if nvml is not None else load_nvml()
    if nvml is None:
        return None
    try:
        nvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound / DriverNotLoaded: a node without NVIDIA GPUs
        return None
    try:
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        gpus = tuple(_gpu_info(nvml, index, handle) for index, handle in enumerate(handles))
        linked = [[i == j or _nvlinked(nvml, a, b) for j, b in enumerate(handles)] for i, a in enumerate(handles)]
        return gpus, clique_islands(len(handles), linked)
    finally:
        nvml.nvmlShutdown()


def _gpu_info(nvml: Any, index: int, handle: Any) -> GpuInfo:
    name = nvml.nvmlDeviceGetName(handle)
    return GpuInfo(
        index=index,
        name=name.decode() if isinstance(name, bytes) else str(name),
        memory_gb=nvml.nvmlDeviceGetMemoryInfo(handle).total / 1e9,
        pci_bus_id=normalize_bus_id(nvml.nvmlDeviceGetPciInfo(handle).busId),
        numa_node=_numa_node(nvml, handle),
    )


def _numa_node(nvml: Any, handle: Any) -> int:
    # nvmlDeviceGetNumaNodeId exists from driver 550 on; older drivers leave it to sysfs.
    getter = getattr(nvml, "nvmlDeviceGetNumaNodeId", None)
    if getter is None:
        return -1
    try:
        return int(getter(handle))
    except Exception:
        return -1


def _nvlinked(nvml: Any, a: Any, b: Any) -> bool:
    """Whether two GPUs reach each other over NVLink (directly or through NVSwitch)."""
    try:
        status = nvml.nvmlDeviceGetP2PStatus(a, b, nvml.NVML_P2P_CAPS_INDEX_NVLINK)
    except Exception:  # NVMLError_NotSupported on GPUs without NVLink
        return False
    return status == nvml.NVML_P2P_STATUS_OK
