"""The public surface of baige-ray: configs, results and errors."""

from baige_ray.api.configs import RunConfig, ScalingConfig, TrainConfig
from baige_ray.api.errors import (
    BaigeError, CheckpointError, ClusterError, InfeasiblePlanError, LayoutMemoryError, ServingError, WorkerError,
)
from baige_ray.api.result import Result, StepMetrics

__all__ = [
    "BaigeError",
    "CheckpointError",
    "ClusterError",
    "InfeasiblePlanError",
    "LayoutMemoryError",
    "Result",
    "RunConfig",
    "ScalingConfig",
    "ServingError",
    "StepMetrics",
    "TrainConfig",
    "WorkerError",
]
