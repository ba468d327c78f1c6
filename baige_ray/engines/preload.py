"""Import, before a worker is needed, what building a job's engine imports: a spare that takes a lost
rank then builds its engine in milliseconds instead of seconds (torch.optim's first optimizer alone
imports torch._dynamo: 1.6 s on a 2-core machine, most of a recovery)."""

from __future__ import annotations

import logging
import time

import torch

from baige_ray.engines.factory import engine_class
from baige_ray.engines.train_job import TrainJob
from baige_ray.parallel.layout import ParallelLayout

logger = logging.getLogger(__name__)


def preload(job: TrainJob, layout: ParallelLayout) -> float:
    """Import the engine `layout` runs `job` with, torch.optim's lazy imports and the model's own modules
    (the model built once on the meta device: no memory, no weights read). Returns the seconds it took.

    A warm-up only: where it fails, the engine built for real reports the problem, so it logs and goes on."""
    began = time.perf_counter()
    try:
        engine_class(layout, job)
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
        with torch.device("meta"):
            job.plugin.build_model()
    except Exception:
        logger.warning("preloading the engine's imports failed; the engine will import them when built", exc_info=True)
    return time.perf_counter() - began
