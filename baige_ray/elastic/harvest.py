"""The elastic controller's harvesting: training ranks that share a serving device with its replica.

A harvested device holds a Serve replica (asking for 1 - share of it) and one training worker
asking for `share` of it. Such a rank is an ordinary data-parallel member; only its device is not
its own. Harvest ranks start in the background while training runs, and the job switches to them
in one regroup; giving a device back to inference is one regroup without them.

Whole workers and harvest ranks are counted apart: `resize` sizes the whole workers (what the
pool lends and reclaims), `harvest` the ranks beside replicas. Split from actors/controller.py to
keep each file small; only ElasticController uses it.
"""

from __future__ import annotations

from baige_ray.elastic.machine import Phase
from baige_ray.elastic.workers import Worker, WorkerPool


class HarvestMixin:
    def _whole_members(self) -> list[Worker]:
        return [worker for worker in self.members if worker.share >= 1]

    def _harvest_members(self) -> list[Worker]:
        return [worker for worker in self.members if worker.share < 1]

    def _check_harvest(self, count: int, share: float) -> None:
        if self.planner is not None:
            raise ValueError("harvest is for jobs with a fixed layout: a planned job lays out whole devices only")
        if not 0 < share < 1:
            raise ValueError(f"share={share} is invalid: expected 0 < share < 1 (the fraction of a serving device)")
        total = len(self._whole_members()) + count
        if count < 0 or total not in self.sizes:
            raise ValueError(f"harvest count={count} is invalid: {len(self._whole_members())} whole workers plus "
                             f"{count} would be {total} ranks; expected a size in {list(self.sizes)}")

    def _start_harvest_workers(self, count: int, share: float, timeout_s: float) -> list[Worker]:
        """Start `count` harvest ranks and wait for them (training runs meanwhile); those that did not
        come up within `timeout_s` (no device has `share` free) are stopped."""
        started = self.pool.start(count, share=share)
        up = WorkerPool.ready(started, timeout_s)
        self.pool.stop([worker for worker in started if worker not in up])
        return up

    def _reharvest(self) -> tuple[Phase, str]:
        """Regroup with the requested harvest ranks: the new ones (already up) join, surplus ones leave."""
        wanted, self._harvest_request = self._harvest_request, None
        incoming, self._harvest_incoming = self._harvest_incoming, []
        harvest = self._harvest_members()
        kept, released = harvest[:wanted], harvest[wanted:]
        members = WorkerPool.by_locality(self._whole_members() + kept + incoming[: max(0, wanted - len(kept))])
        released += incoming[max(0, wanted - len(kept)):]
        before = len(self.members)
        if len(members) != before or released:
            failed = self._switch_to(members, released)
            if failed is not None:
                return failed
            harvested = len(self._harvest_members())
            self.events.record("harvest", self._harvest_reason or f"{harvested} rank(s) beside replicas",
                               train_devices=len(self._whole_members()), harvested_devices=harvested,
                               resume_step=self.step)
        self._resize_done.set()
        return Phase.RUNNING, f"{before} -> {len(self.members)} ranks, {len(self._harvest_members())} harvesting"
