"""The pool arbiter's serving sides: a `serve()` application scaled and refreshed in place, and a
disaggregated application (serving/disaggregation.py).

The arbiter decides how many devices serving holds; the disaggregated side splits them between prefill and
decode replicas by each side's queue, under the application's split policy
(policies/disaggregation.py, applied by serving/disaggregation_scaling.py): a lend's replicas go to
the busier side, a reclaim's come from the idler one, and while the arbiter holds, `rebalance` may
move one replica between the sides.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from baige_ray.policies.disaggregation import SplitDecision


class ServeServingSide:
    """The serving side: a `serve()` application scaled and refreshed in place."""

    def __init__(self, info: Any, model_config: Any):
        self.info, self.model_config = info, model_config

    def num_replicas(self) -> int:
        from baige_ray.serving.app import replica_states

        return replica_states(self.info).get("RUNNING", 0)

    def load(self, window_s: float) -> dict:
        from baige_ray.serving.app import serving_load

        return serving_load(self.info, window_s)

    def scale(self, num_replicas: int) -> None:
        from baige_ray.serving.app import scale_replicas

        scale_replicas(self.info, num_replicas)

    def reload(self, step: int, state_ref: Any) -> None:
        from baige_ray.serving.app import reload_weights

        # A lend's new replica loads the published weights as it starts; the running ones swap
        # at their next report, so the lend does not wait for them.
        reload_weights(self.info, (step, state_ref), model_config=self.model_config, wait=False)

    def rebalance(self) -> str | None:
        return None  # one role: nothing to re-split

    def return_idle_memory(self) -> int:
        from baige_ray.serving.proxy_memory import return_proxy_memory

        return sum(max(0, proxy.returned) for proxy in return_proxy_memory())


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


def serving_side(info: Any, model_config: Any, min_infer_devices: int) -> ServeServingSide:
    """The side for `info`'s application; `min_infer_devices` is the arbiter's floor (ArbiterConfig)."""
    if not info.disaggregated:
        return ServeServingSide(info, model_config)
    if min_infer_devices < info.split.min_replicas:
        raise ValueError(f"ArbiterConfig.min_infer_devices={min_infer_devices} is invalid for a disaggregated "
                         f"application: expected at least its split's minimum prefill + decode replicas "
                         f"({info.split.min_replicas})")
    return DisaggregatedServingSide(info, model_config)
