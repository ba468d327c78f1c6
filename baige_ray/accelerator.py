"""Which accelerator a process sees, and how Ray and torch.distributed name it.

One table maps each kind to its Ray resource, torch device type, collective
backend and the environment variable Ray uses to pin visible devices. Detection
asks a probe, so every kind can be tested on a machine that has none of them.
"""

from __future__ import annotations

import enum
import importlib.util
from dataclasses import dataclass
from typing import Protocol


class AcceleratorKind(str, enum.Enum):
    CUDA = "cuda"
    XPU = "xpu"
    NPU = "npu"
    CPU = "cpu"


@dataclass(frozen=True)
class AcceleratorSpec:
    kind: AcceleratorKind
    ray_resource: str
    torch_device_type: str
    dist_backend: str
    visible_devices_env: str | None

    @property
    def is_accelerator(self) -> bool:
        return self.kind is not AcceleratorKind.CPU

    @property
    def process_group_backend(self) -> str:
        """What workers initialize torch.distributed with: on accelerators their collective library for device
        tensors and gloo for host tensors (a loss, a norm, a count the ranks agree on), which the library alone
        refuses ("No backend type associated with device type cpu")."""
        if not self.is_accelerator:
            return self.dist_backend
        return f"cpu:gloo,{self.torch_device_type}:{self.dist_backend}"

    def torch_device(self, index: int = 0) -> str:
        return self.torch_device_type if not self.is_accelerator else f"{self.torch_device_type}:{index}"


# Ray schedules NVIDIA and Intel GPUs under the "GPU" resource and Ascend under "NPU".
# ROCm/DCU devices present themselves to torch as CUDA and take the CUDA row.
SPECS: dict[AcceleratorKind, AcceleratorSpec] = {
    AcceleratorKind.CUDA: AcceleratorSpec(AcceleratorKind.CUDA, "GPU", "cuda", "nccl", "CUDA_VISIBLE_DEVICES"),
    AcceleratorKind.XPU: AcceleratorSpec(AcceleratorKind.XPU, "GPU", "xpu", "xccl", "ONEAPI_DEVICE_SELECTOR"),
    AcceleratorKind.NPU: AcceleratorSpec(AcceleratorKind.NPU, "NPU", "npu", "hccl", "ASCEND_RT_VISIBLE_DEVICES"),
    AcceleratorKind.CPU: AcceleratorSpec(AcceleratorKind.CPU, "CPU", "cpu", "gloo", None),
}


class DeviceProbe(Protocol):
    """What detection needs to know; `TorchDeviceProbe` answers from the live process."""

    def cuda_count(self) -> int: ...

    def xpu_count(self) -> int: ...

    def npu_count(self) -> int: ...


class TorchDeviceProbe:
    def cuda_count(self) -> int:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    def xpu_count(self) -> int:
        import torch

        xpu = getattr(torch, "xpu", None)
        return xpu.device_count() if xpu is not None and xpu.is_available() else 0

    def npu_count(self) -> int:
        # Ascend support arrives through the torch_npu plugin, which registers torch.npu.
        if importlib.util.find_spec("torch_npu") is None:
            return 0
        import torch
        import torch_npu  # noqa: F401

        return torch.npu.device_count() if torch.npu.is_available() else 0


def detect_accelerator(probe: DeviceProbe | None = None) -> AcceleratorSpec:
    """The first accelerator kind with at least one visible device, else CPU."""
    probe = probe or TorchDeviceProbe()
    if probe.cuda_count() > 0:
        return SPECS[AcceleratorKind.CUDA]
    if probe.xpu_count() > 0:
        return SPECS[AcceleratorKind.XPU]
    if probe.npu_count() > 0:
        return SPECS[AcceleratorKind.NPU]
    return SPECS[AcceleratorKind.CPU]


def spec_for(kind: str | AcceleratorKind) -> AcceleratorSpec:
    try:
        return SPECS[AcceleratorKind(kind)]
    except ValueError:
        allowed = ", ".join(k.value for k in AcceleratorKind)
        raise ValueError(f"accelerator kind={kind!r} is invalid: expected one of {allowed}") from None
