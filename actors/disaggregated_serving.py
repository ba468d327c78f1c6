"""The pool arbiter's serving side for a disaggregated application (serving/disaggregation.py).

The arbiter decides how many devices serving holds; this side splits them between prefill and
decode replicas by each side's queue, under the application's split policy
(policies/disaggregation.py, applied by serving/disaggregation_scaling.py): a lend's replicas go to
the busier side, a reclaim's come from the idler one, and while the arbiter holds, `rebalance` may
move one replica between the sides.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from baige_ray.actors.arbiter import ServeServingSide
from baige_ray.policies.disaggregation import SplitDecision


class DisaggregatedServingSide(ServeServingSide):
    """A disaggregated application: the arbiter's replica count is split between prefill and decode
    by each side's queue, under the application's split policy."""

    def __init__(self, info: Any, model_config: Any, clock: Callable[[], float] = time.monotonic):
        super().__init__(info, model_config)
        self.clock = clock
        self._last_move = -float("inf")

    def num_replicas(self) -> int:
        from baige_ray.serving.disaggregation_scaling import side_loads

        return sum(load.num_replicas for load in side_loads(self.info).values())

    def scale(self, num_replicas: int) -> None:
        self._split(num_replicas)

    def rebalance(self) -> str | None:
        decision = self._split(None)
        return None if decision is None else decision.reason

    def _split(self, num_replicas: int | None) -> SplitDecision | None:
        from baige_ray.serving.disaggregation_scaling import rebalance

        decision = rebalance(self.info, num_replicas=num_replicas, seconds_since_move=self.clock() - self._last_move)
        if decision is not None:
            self._last_move = self.clock()
        return decision
