"""Pick the engine a layout needs."""

from __future__ import annotations

import importlib
from typing import Any

from baige_ray.engines.base import Engine
from baige_ray.engines.train_job import TrainJob
from baige_ray.parallel.layout import ParallelLayout

# Engines a model brings of its own, by the name its plug-in gives (ModelPlugin.engine).
OWN_ENGINES = {"mlp": ("baige_ray.engines.mlp_engine", "MLPEngine")}


def engine_class(layout: ParallelLayout, job: TrainJob | None = None) -> type[Engine]:
    """The model's own engine if its plug-in names one, else DeepSpeed for ZeRO stages and the
    torch-native engine for everything else (imported lazily: all are heavy)."""
    own = job.plugin.engine if job is not None else None
    if own is not None:
        module, name = OWN_ENGINES[own]
        return getattr(importlib.import_module(module), name)
    if layout.data_parallel.startswith("zero"):
        from baige_ray.engines.deepspeed_engine import DeepSpeedEngine

        return DeepSpeedEngine
    from baige_ray.engines.torch_engine import TorchEngine

    return TorchEngine


def build_engine(job: TrainJob, layout: ParallelLayout, rank: int = 0, **options: Any) -> Engine:
    """Options (device, emulated_speed, data) go to the engine's constructor."""
    return engine_class(layout, job)(job, layout, rank, **options)
