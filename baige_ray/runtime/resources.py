"""What each worker of a job reserves from Ray: its device resource and its bundle."""

from __future__ import annotations

from baige_ray.api.configs import ScalingConfig
from baige_ray.api.errors import ClusterError


def choose_device_resource(scaling: ScalingConfig, cluster_resources: dict[str, float]) -> str:
    """The Ray resource each worker holds: "GPU" (real or simulated) or "CPU"."""
    available_gpus = cluster_resources.get("GPU", 0.0)
    if scaling.accelerator == "cpu":
        return "CPU"
    if scaling.accelerator == "gpu" or available_gpus >= scaling.num_workers:
        if available_gpus < scaling.num_workers:
            raise ClusterError(
                f"ScalingConfig(num_workers={scaling.num_workers}, accelerator='gpu') needs "
                f"{scaling.num_workers} GPUs; the cluster has {available_gpus:g}"
            )
        return "GPU"
    return "CPU"


def worker_bundle(scaling: ScalingConfig, resource: str) -> dict[str, float]:
    """What one worker reserves: its device (`device_share` of one) plus a CPU share (a whole CPU when the
    CPU is the device)."""
    if resource == "CPU":
        return {"CPU": max(scaling.cpus_per_worker, 1.0)}
    return {resource: scaling.device_share, "CPU": scaling.cpus_per_worker}
