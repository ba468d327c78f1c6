"""Pick the engine a layout needs."""

from __future__ import annotations

from typing import Any

from baige_ray.engines.base import Engine
from baige_ray.engines.layout import ParallelLayout
from baige_ray.runtime.train_loop import TrainJob


def engine_class(layout: ParallelLayout, job: TrainJob | None = None) -> type[Engine]:
    """The model's own engine if its plug-in has one, else DeepSpeed for ZeRO stages and the torch-native
    engine for everything else (imported lazily: both are heavy)."""
    own = job.plugin.engine_class(layout) if job is not None else None
    if own is not None:
        return own
    if layout.data_parallel.startswith("zero"):
        from baige_ray.engines.deepspeed_engine import DeepSpeedEngine

        return DeepSpeedEngine
    from baige_ray.engines.torch_engine import TorchEngine

    return TorchEngine


def build_engine(job: TrainJob, layout: ParallelLayout, rank: int = 0, **options: Any) -> Engine:
    """Options (device, emulated_speed, data) go to the engine's constructor."""
    return engine_class(layout, job)(job, layout, rank, **options)
