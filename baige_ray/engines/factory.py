"""Pick the engine a layout needs."""

from __future__ import annotations

from baige_ray.engines.base import Engine
from baige_ray.engines.layout import ParallelLayout
from baige_ray.models.corpus import ByteCorpus
from baige_ray.runtime.train_loop import TrainJob


def build_engine(
    job: TrainJob,
    layout: ParallelLayout,
    rank: int = 0,
    *,
    device: str = "cpu",
    emulated_speed: float = 1.0,
    corpus: ByteCorpus | None = None,
) -> Engine:
    if layout.data_parallel.startswith("zero"):
        from baige_ray.engines.deepspeed_engine import DeepSpeedEngine

        return DeepSpeedEngine(job, layout, rank, device=device, emulated_speed=emulated_speed, corpus=corpus)
    from baige_ray.engines.torch_engine import TorchEngine

    return TorchEngine(job, layout, rank, device=device, emulated_speed=emulated_speed, corpus=corpus)
