"""Shared test doubles: worker classes with injected misbehaviour."""

from __future__ import annotations

from baige_ray.actors.worker import WorkerActor


class FailingStepWorker(WorkerActor):
    """A worker whose `train_step` raises on one rank at one step."""

    fail_rank = 1
    fail_step = 1

    def train_step(self, step: int) -> dict[str, float]:
        membership = self._require_membership()
        if membership.rank == self.fail_rank and step == self.fail_step:
            raise RuntimeError(f"injected failure at rank {membership.rank}, step {step}")
        return super().train_step(step)
