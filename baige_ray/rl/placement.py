"""Where a GRPO run's parts hold their devices, decided by pure functions.

"split": rollout replicas, training workers and the KL penalty's reference policy hold devices (or
the shares of one) of their own. "hybrid": no replicas; each training worker samples from its own
weights (rl/hybrid.py). "colocated": each device holds one rollout replica and one training
worker, which take turns (the replica's engine gives its device memory back while the worker trains),
and the reference policy beside them. Ray counts these shares to place the actors: a replica's share
is above one half, so two replicas never pair up, and a worker's fits exactly beside a replica and the
reference (Ray fills the fullest device a share fits on). The shares do not divide the device's memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

PLACEMENTS = ("split", "colocated", "hybrid")


@dataclasses.dataclass(frozen=True)
class DeviceShares:
    replica: float
    worker: float
    reference: float


COLOCATED_SHARES = DeviceShares(replica=0.55, worker=0.35, reference=0.1)


def device_shares(placement: str, *, replica: float, worker: float, reference: float) -> DeviceShares:
    """The shares a run asks for: the colocated ones, or those configured."""
    if placement == "colocated":
        return COLOCATED_SHARES
    if placement == "hybrid":
        return DeviceShares(replica=0.0, worker=worker, reference=reference)
    return DeviceShares(replica=replica, worker=worker, reference=reference)


def check_colocation(placement: str, *, num_replicas: int, num_workers: int, num_spares: int) -> None:
    """A colocated run pairs each worker with a replica on one device: as many of each, no spare workers."""
    if placement != "colocated":
        return
    if num_replicas != num_workers:
        raise ValueError(f"RolloutOptions.num_replicas={num_replicas} is invalid with placement='colocated': expected "
                         f"one replica per training worker, ScalingConfig.num_workers={num_workers}")
    if num_spares:
        raise ValueError(f"ElasticConfig.num_spares={num_spares} is invalid with placement='colocated': a spare would "
                         "hold a device no replica shares; expected 0")


def check_off_policy(lag: int, placement: str, *, sized: bool) -> None:
    """Rollouts overlap training only on replicas of their own; the split's sizing policy prices an
    iteration as its phases in turn, which overlapping ones are not."""
    if lag and (placement != "split" or sized):
        raise ValueError(f"GRPOConfig.off_policy_lag={lag} is invalid with placement={placement!r}"
                         + (" and sizing set" if sized else "") + ": rollouts overlap training only on replicas "
                         "of their own (placement 'split', without sizing)")


def check_hybrid(placement: str, *, num_replicas: int, engine: str, updates_per_iteration: int, kl_coef: float,
                 layout: Any, rollout_faults: Any) -> None:
    """Rollouts on the training ranks: each rank holds the whole model (DDP), samples each step from the
    weights it starts from, and there are no replicas to size, choose an engine for, or kill."""
    if placement != "hybrid":
        return
    problems = {
        "RolloutOptions.num_replicas": (num_replicas, num_replicas != 1, "every training worker samples; expected 1"),
        "RolloutOptions.engine": (engine, engine != "builtin", "the workers sample with the built-in engine"),
        "GRPOConfig.updates_per_iteration": (updates_per_iteration, updates_per_iteration != 1,
                                             "each step samples from the weights it starts from; expected 1"),
        "PolicyLossConfig.kl_coef": (kl_coef, kl_coef > 0, "no reference policy runs beside the workers yet"),
        "rollout_faults": (rollout_faults, rollout_faults is not None,
                           "there are no replicas: kill a training worker with faults=FaultPlan"),
        "layout": (layout, not _whole_model_on_each_rank(layout),
                   "each rank must hold the whole model, unsharded: 'ddp' (the default) or a ParallelLayout "
                   "of data parallelism by DDP"),
    }
    for name, (value, wrong, why) in problems.items():
        if wrong:
            raise ValueError(f"{name}={value!r} is invalid with placement='hybrid': {why}")


def _whole_model_on_each_rank(layout: Any) -> bool:
    from baige_ray.parallel.layout import ParallelLayout

    if layout is None or layout == "ddp":
        return True
    return isinstance(layout, ParallelLayout) and layout.tp == layout.pp == layout.ep == 1 and (
        layout.dp == 1 or layout.data_parallel == "ddp")


def devices_needed(shares: DeviceShares, *, num_replicas: int, num_workers: int,
                   reference: bool) -> dict[str, float]:
    needed = {"rollout replicas": num_replicas * shares.replica} if shares.replica else {}
    needed["training workers (spares included)"] = num_workers * shares.worker
    if reference:
        needed["the reference policy"] = shares.reference
    return needed


def check_devices(needed: dict[str, float], available: float) -> None:
    """Refuse a run whose parts cannot all hold their devices at once (where the pool has devices: on
    CPUs every part shares the cores), naming what each needs, before anything starts."""
    if available <= 0 or sum(needed.values()) <= available + 1e-9:
        return
    parts = ", ".join(f"{name} {amount:g}" for name, amount in needed.items())
    raise ValueError(f"the run needs {sum(needed.values()):g} devices ({parts}) and the pool has {available:g}: "
                     "use fewer workers or replicas, or smaller RolloutOptions.device_share / reference_device_share")


def shared_devices(replica_devices: Iterable[tuple[str, int]], worker_devices: Iterable[tuple[str, int]]) -> int:
    """Devices, as (node id, device index), that hold both a rollout replica and a training worker."""
    return len(set(replica_devices) & set(worker_devices))
