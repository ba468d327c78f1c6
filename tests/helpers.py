"""Shared test helpers: single-process references and worker classes with injected misbehaviour."""

from __future__ import annotations

from baige_ray.actors.worker import WorkerActor
from baige_ray.engines.factory import build_engine
from baige_ray.engines.layout import ParallelLayout
from baige_ray.runtime.train_loop import TrainJob


def reference_losses(job: TrainJob, num_steps: int | None = None) -> list[float]:
    """Losses of one process holding the whole model and the whole global batch."""
    engine = build_engine(job, ParallelLayout())
    return [engine.train_step(step)["loss"] for step in range(num_steps or job.train.num_steps)]


class FailingStepWorker(WorkerActor):
    """A worker whose `train_step` raises on one rank at one step."""

    fail_rank = 1
    fail_step = 1

    def train_step(self, step: int) -> dict[str, float]:
        membership = self._require_membership()
        if membership.rank == self.fail_rank and step == self.fail_step:
            raise RuntimeError(f"injected failure at rank {membership.rank}, step {step}")
        return super().train_step(step)
