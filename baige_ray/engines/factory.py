"""Pick the engine a layout needs."""

from __future__ import annotations

from typing import Any

from baige_ray.engines.base import Engine
from baige_ray.engines.layout import ParallelLayout
from baige_ray.runtime.train_loop import TrainJob


def engine_class(layout: ParallelLayout, job: TrainJob | None = None) -> type[Engine]:
    """DeepSpeed for ZeRO stages, the torch-native engine for everything else (imported lazily: both are heavy)."""
    from baige_ray.models.mlp import MLPConfig

    if job is not None and isinstance(job.model, MLPConfig):
        from baige_ray.engines.mlp_engine import MLPEngine

        return MLPEngine
    if layout.data_parallel.startswith("zero"):
        from baige_ray.engines.deepspeed_engine import DeepSpeedEngine

        return DeepSpeedEngine
    from baige_ray.engines.torch_engine import TorchEngine

    return TorchEngine


def build_engine(job: TrainJob, layout: ParallelLayout, rank: int = 0, **options: Any) -> Engine:
    """Options (device, emulated_speed, corpus) go to the engine's constructor."""
    return engine_class(layout, job)(job, layout, rank, **options)
