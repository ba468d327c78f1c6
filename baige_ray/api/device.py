"""What a worker reports about the device it holds."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceInfo:
    node_id: str
    node_ip: str
    hostname: str
    pid: int
    device_kind: str
    device_index: int
    device_name: str
    memory_bytes: int
    ray_resource: str
    simulated: bool

    @property
    def location(self) -> tuple[str, int]:
        """Sort key that keeps ranks on one node, and neighbouring devices, adjacent."""
        return (self.node_id, self.device_index)
