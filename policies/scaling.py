"""When to grow a shrunken job back, and how many warm spares to keep."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GrowthObservation:
    num_workers: int
    target_workers: int  # the size the job wants (its max_workers, less devices lent to inference)
    free_devices: int
    num_spares: int
    valid_sizes: tuple[int, ...]


def grow_to(obs: GrowthObservation) -> int:
    """The group size to grow to now (== num_workers: stay), using spares first, then free devices."""
    reachable = min(obs.target_workers, obs.num_workers + obs.num_spares + obs.free_devices)
    fitting = [size for size in obs.valid_sizes if obs.num_workers < size <= reachable]
    return max(fitting, default=obs.num_workers)


def spares_to_start(wanted: int, have: int, free_devices: int) -> int:
    """Start spares only on devices nobody needs: never more than are free."""
    return max(0, min(wanted - have, free_devices))
