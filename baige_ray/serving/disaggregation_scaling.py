"""Resizing a disaggregated application's two sides, and sizing each from its own queue.

`scale_sides` sets each side's replica count and waits until exactly those run: the shrinking side
first, so the devices it gives up are free before the other side asks for them (Serve drains the
replicas it stops; no request is dropped). `rebalance` observes both sides (running replicas from
Serve, queues as the replicas last reported them to the registry), asks the split policy
(policies/disaggregation.py) and applies its answer. The pool arbiter calls it; so can anyone
serving without one.
"""

from __future__ import annotations

import dataclasses
import math

import ray

from baige_ray.api.validation import require_int
from baige_ray.policies.disaggregation import SideLoad, SplitDecision, SplitObservation, split_replicas
from baige_ray.serving.app import ServeHandleInfo, replica_states, set_replicas
from baige_ray.serving.registry import REGISTRY_NAMESPACE, registry_name

_NO_REPORTS = SideLoad(num_replicas=0, num_waiting=0, num_running=0)


def _deployments(info: ServeHandleInfo) -> dict[str, str]:
    if not info.disaggregated:
        raise ValueError(f"{info.app_name} is not disaggregated: serve it with "
                         "disaggregation=DisaggregationOptions(...) or scale it with scale_replicas")
    return {"prefill": info.prefill_deployment_name, "decode": info.deployment_name}


def side_loads(info: ServeHandleInfo) -> dict[str, SideLoad]:
    """Each side's running replicas and its engines' queues ("prefill" and "decode")."""
    deployments = _deployments(info)
    registry = ray.get_actor(registry_name(info.app_name), namespace=REGISTRY_NAMESPACE)
    reported = ray.get(registry.side_loads.remote())
    return {side: dataclasses.replace(reported.get(side, _NO_REPORTS),
                                      num_replicas=replica_states(info, name).get("RUNNING", 0))
            for side, name in deployments.items()}


def scale_sides(info: ServeHandleInfo, *, prefill_replicas: int, decode_replicas: int,
                timeout_s: float = 180.0) -> None:
    """Set both sides' replica counts and wait until exactly those run and none start or stop."""
    deployments = _deployments(info)
    require_int("scale_sides", "prefill_replicas", prefill_replicas, minimum=1)
    require_int("scale_sides", "decode_replicas", decode_replicas, minimum=1)
    counts = {deployments["prefill"]: prefill_replicas, deployments["decode"]: decode_replicas}
    shrinking = {name: count for name, count in counts.items()
                 if count < replica_states(info, name).get("RUNNING", 0)}
    if shrinking:
        set_replicas(info, shrinking, timeout_s=timeout_s)
    set_replicas(info, counts, timeout_s=timeout_s)


def rebalance(info: ServeHandleInfo, *, num_replicas: int | None = None,
              seconds_since_move: float = math.inf) -> SplitDecision | None:
    """Split `num_replicas` (by default as many as run now) between the sides by their queues, under
    the application's split policy; returns the decision if it changed the split, else None."""
    loads = side_loads(info)
    total = sum(load.num_replicas for load in loads.values()) if num_replicas is None else num_replicas
    observation = SplitObservation(prefill=loads["prefill"], decode=loads["decode"], num_replicas=total,
                                   seconds_since_move=seconds_since_move)
    decision = split_replicas(observation, info.split)
    if not decision.changes(observation):
        return None
    scale_sides(info, prefill_replicas=decision.prefill_replicas, decode_replicas=decision.decode_replicas)
    return decision
