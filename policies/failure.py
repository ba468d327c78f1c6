"""What to do when workers are lost: replace them from spares, shrink, wait for capacity, or give up."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class FailureAction(Enum):
    REPLACE = "replace"  # same world size: spares take the lost ranks
    SHRINK = "shrink"  # fewer whole data-parallel replicas
    WAIT = "wait"  # too few devices to go on; resume when capacity returns
    FAIL = "fail"


@dataclass(frozen=True)
class FailureObservation:
    num_workers: int  # the group's size when the failure happened
    num_lost: int
    num_spares: int  # warm spares ready now
    min_workers: int
    valid_sizes: tuple[int, ...]  # group sizes the layout and the global batch allow
    recoveries_so_far: int
    max_recoveries: int


@dataclass(frozen=True)
class FailureDecision:
    action: FailureAction
    num_workers: int
    num_from_spares: int
    reason: str


def decide_failure(obs: FailureObservation) -> FailureDecision:
    if obs.recoveries_so_far >= obs.max_recoveries:
        return FailureDecision(FailureAction.FAIL, 0, 0, f"{obs.recoveries_so_far} recoveries already, the limit")
    survivors = obs.num_workers - obs.num_lost
    if obs.num_spares >= obs.num_lost:
        return FailureDecision(
            FailureAction.REPLACE, obs.num_workers, obs.num_lost, f"{obs.num_lost} spare(s) take the lost rank(s)"
        )
    usable = survivors + obs.num_spares
    fitting = [size for size in obs.valid_sizes if size <= usable]
    target = max(fitting, default=0)
    if target >= obs.min_workers and target > 0:
        return FailureDecision(
            FailureAction.SHRINK,
            target,
            max(0, target - survivors),
            f"{survivors} survivor(s) and {obs.num_spares} spare(s): continue on {target} worker(s)",
        )
    return FailureDecision(
        FailureAction.WAIT, obs.min_workers, 0, f"{usable} usable worker(s) < min_workers={obs.min_workers}"
    )
