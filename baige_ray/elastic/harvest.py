"""Harvesting, decided by pure functions: training ranks that share a serving device with its replica.

A harvested device holds a Serve replica (asking for 1 - share of it) and one training worker
asking for `share` of it. Such a rank is an ordinary data-parallel member; only its device is not
its own. Harvest ranks start in the background while training runs, and the job switches to them
in one regroup; giving a device back to inference is one regroup without them.

Whole workers and harvest ranks are counted apart: `resize` sizes the whole workers (what the
pool lends and reclaims), `harvest` the ranks beside replicas. The controller starts and stops the
workers and regroups; what to regroup with is `harvest_regroup`.
"""

from __future__ import annotations

from collections.abc import Sequence

from baige_ray.elastic.commands import Harvest
from baige_ray.elastic.workers import Worker, WorkerPool


def whole_members(members: Sequence[Worker]) -> list[Worker]:
    return [worker for worker in members if worker.share >= 1]


def harvest_members(members: Sequence[Worker]) -> list[Worker]:
    return [worker for worker in members if worker.share < 1]


def check_harvest(count: int, share: float, *, num_whole: int, sizes: Sequence[int], planned: bool) -> None:
    """Refuse a harvest the job cannot run, naming the field."""
    if planned:
        raise ValueError("harvest is for jobs with a fixed layout: a planned job lays out whole devices only")
    if not 0 < share < 1:
        raise ValueError(f"share={share} is invalid: expected 0 < share < 1 (the fraction of a serving device)")
    total = num_whole + count
    if count < 0 or total not in sizes:
        raise ValueError(f"harvest count={count} is invalid: {num_whole} whole workers plus "
                         f"{count} would be {total} ranks; expected a size in {list(sizes)}")


def harvest_regroup(members: Sequence[Worker], request: Harvest) -> tuple[list[Worker], list[Worker]]:
    """(members to regroup with, workers to stop): the whole workers, the harvest ranks kept (oldest
    first) and as many incoming ones as `request.wanted` still needs; the rest are released."""
    harvest = harvest_members(members)
    kept, released = harvest[:request.wanted], harvest[request.wanted:]
    joining = max(0, request.wanted - len(kept))
    regrouped = WorkerPool.by_locality(whole_members(members) + kept + list(request.incoming[:joining]))
    return regrouped, released + list(request.incoming[joining:])
