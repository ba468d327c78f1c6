"""Who trains: the members in rank order, the layout and generation they form, and the warm spares.

The one owner of that state. Recovery, resizing and harvesting decide who should train; the crew
starts, stops and regroups workers to make it so, through the worker pool.
"""

from __future__ import annotations

import ray

from baige_ray.elastic.accounts import StepAccounts
from baige_ray.elastic.device_holds import ReleasedDevices
from baige_ray.elastic.faults import FaultPlan
from baige_ray.elastic.harvest import harvest_members
from baige_ray.elastic.job_record import JobRecord
from baige_ray.elastic.part_clock import slowest_parts
from baige_ray.elastic.planning import ElasticPlanner
from baige_ray.elastic.sizing import layout_for
from baige_ray.elastic.state_sources import CALL_TIMEOUT_S
from baige_ray.elastic.workers import Worker, WorkerPool
from baige_ray.engines.train_job import TrainJob
from baige_ray.ops.events import EventLog
from baige_ray.parallel.layout import ParallelLayout
from baige_ray.policies.scaling import spares_to_start
from baige_ray.policies.straggler import relative_loads


class Crew:
    def __init__(self, job: TrainJob, layout: ParallelLayout, pool: WorkerPool, *, planner: ElasticPlanner | None,
                 accounts: StepAccounts, events: EventLog, faults: FaultPlan, record: JobRecord,
                 placement_timeout_s: float, released: ReleasedDevices):
        self.job, self.pool, self.planner = job, pool, planner
        self.released = released  # devices a resize freed for someone else: spares leave them alone
        self.accounts, self.events, self.faults, self.record = accounts, events, faults, record
        self.placement_timeout_s = placement_timeout_s
        self.requested_layout = layout  # resizes derive from it: an EP degree cut by a shrink comes back on growth
        self.layout = layout
        self.members: list[Worker] = []
        self.spares: list[Worker] = []
        self.generation = -1
        self.failed_regroups = 0  # in a row, since the last group formed
        self.last_regroup_parts: dict[str, float] = {}  # the slowest member's seconds per part of the last regroup

    def layout_for(self, num_workers: int) -> ParallelLayout:
        return layout_for(self.requested_layout, num_workers, self.job)

    # ----- spares -----

    def ready_spares(self) -> list[Worker]:
        return self.pool.ready(self.spares)

    def start_spares(self, wanted: int) -> None:
        count = spares_to_start(wanted, 0, self.pool.free_devices() - self.released.held()) if wanted > 0 else 0
        if count:
            self.spares.extend(self.pool.start(count))

    def hold_released(self, workers: list[Worker]) -> None:
        """`workers` were stopped for someone else: spares leave their devices alone for the hold."""
        self.released.hold(sum(1 for w in workers if w.share >= 1))  # harvest ranks free no whole device

    def end_holds(self) -> None:
        """The job is asked to grow: the devices it let go of are its own again."""
        self.released.end()

    def never_started_spares(self) -> list[Worker]:
        """Spares whose actor died before it came up (their device info never arrived)."""
        return [w for w in self.spares if w.info is None and w.ready_ref is None]

    def drop_spares(self, workers: list[Worker]) -> None:
        """Stop `workers` and forget them as spares (dead or silent: they would fail the regroup they join)."""
        self.pool.stop(workers)
        self.take_spares(workers)

    def drop_dead_spares(self) -> None:
        """Forget ready spares that no longer answer (spares still starting are left alone)."""
        ready = self.ready_spares()
        self.drop_spares([w for w, alive in zip(ready, self.pool.responsive(ready)) if not alive])

    def add_spares(self, workers: list[Worker]) -> None:
        self.spares.extend(workers)

    def take_spares(self, workers: list[Worker]) -> None:
        """They stop being spares: they join the members, or are stopped."""
        self.spares = [w for w in self.spares if w not in workers]

    def take_or_start(self, count: int) -> list[Worker] | None:
        """`count` ready workers: warm spares first, then new actors (waiting for them to start)."""
        if count <= 0:
            return []
        self.drop_dead_spares()
        taken = self.ready_spares()[:count]
        self.take_spares(taken)
        started = self.pool.start(count - len(taken))
        up = self.pool.ready(started, self.placement_timeout_s) if started else []
        if len(taken) + len(up) < count:
            self.pool.stop(taken + started)
            return None
        return taken + up

    # ----- forming a generation -----

    def regroup(self, members: list[Worker], state_parts: list[ray.ObjectRef] | None, step: int) -> None:
        """Form the next generation from `members` (rank order; the planner may reorder or leave some
        idle) and load `state_parts` into it; raises if a member fails to join."""
        arrangement = self.planner.arrange(members) if self.planner is not None else None
        if arrangement is not None:
            members, layout = list(arrangement.members), arrangement.layout
        else:
            layout = self.layout_for(len(members))
        self.generation += 1
        reports = self.pool.regroup(members, self.generation, self.job, layout, state_parts or [], CALL_TIMEOUT_S,
                                     faults=self.faults.arm_regroup(step))
        self.last_regroup_parts = slowest_parts(reports)
        if arrangement is not None:
            self.planner.commit(arrangement)
            self.spares.extend(arrangement.unused)
            self.events.record("plan", arrangement.describe(), repaired=arrangement.repaired,
                               reshard=arrangement.reshard, step_time_s=arrangement.plan.step_time_s)
        # One rank per pipeline stage counts its stage's parameters (DTensor counts are global).
        self.accounts.new_generation(sum(
            report["num_parameters"] for rank, report in enumerate(reports)
            if layout.coords(rank).dp == 0 and layout.coords(rank).tp == 0 and layout.coords(rank).cp == 0
        ), self._rank_loads(members, layout))
        self.members, self.layout, self.failed_regroups = members, layout, 0
        self.record.save(self.members, self.layout, self.generation)

    def _rank_loads(self, members: list[Worker], layout: ParallelLayout) -> tuple[float, ...]:
        batches = layout.replica_batches(self.job.train)
        return relative_loads([batches[layout.coords(rank).dp] for rank in range(len(members))],
                              [worker.speed for worker in members])

    def assume(self, members: list[Worker], *, layout: ParallelLayout, generation: int) -> None:
        """Take `members` as the group without forming it: the group a restarted controller found."""
        self.members, self.layout, self.generation = members, layout, generation
        self.accounts.new_generation(self.accounts.num_parameters, self._rank_loads(members, layout))

    def regroup_failed(self) -> int:
        """A regroup failed part way; the generation that last formed stays the group recovery starts
        from (its snapshots match its layout). Returns how many regroups in a row have failed."""
        self.failed_regroups += 1
        return self.failed_regroups

    def report(self) -> dict:
        """The job status's part about who trains: the layout, the members by rank, the spares."""
        return {
            "layout": self.layout.describe(),
            "pipeline_stages": self.layout.pp,
            "num_workers": len(self.members),
            "num_harvest": len(harvest_members(self.members)),  # ranks beside a Serve replica
            "num_spares": len(self.spares),
            "workers": [worker.describe(rank) for rank, worker in enumerate(self.members)],
            "spares": [spare.describe(None) for spare in self.spares],  # warm, idle: rank None
        }

    def everyone(self) -> list[Worker]:
        return [w for w in self.members + self.spares if w.actor is not None]
