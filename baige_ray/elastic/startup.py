"""The PLANNING and STARTING phases of the elastic controller: open the run's accounts (or take over
after a controller restart), then start the members and spares and form the first group."""

from __future__ import annotations

import time
from collections.abc import Callable

from baige_ray.api.configs import RunConfig, ScalingConfig
from baige_ray.api.elastic import ElasticConfig
from baige_ray.elastic.accounts import StepAccounts
from baige_ray.elastic.crew import Crew
from baige_ray.elastic.machine import Phase
from baige_ray.elastic.recovery import MAX_REGROUP_RETRIES, Recovery
from baige_ray.elastic.resizing import Resizer
from baige_ray.elastic.workers import Worker, WorkerPool
from baige_ray.ops.events import EventLog

# Ray restarts a dead controller without limit (a job of weeks meets many head-node faults); one that keeps
# dying soon after its restart is broken, not faulted: more than this many restarts within the window fail it.
CRASH_LOOP_RESTARTS = 5
CRASH_LOOP_WINDOW_S = 600.0


class Startup:
    def __init__(self, crew: Crew, pool: WorkerPool, accounts: StepAccounts, recovery: Recovery, resizer: Resizer,
                 events: EventLog, *, run: RunConfig, scaling: ScalingConfig, elastic: ElasticConfig,
                 speeds: list[float], sizes: tuple[int, ...], was_restarted: Callable[[], bool]):
        self.crew, self.pool, self.accounts, self.recovery, self.resizer = crew, pool, accounts, recovery, resizer
        self.events, self.run, self.scaling, self.elastic = events, run, scaling, elastic
        self.speeds, self.sizes, self.was_restarted = speeds, sizes, was_restarted

    def plan(self) -> tuple[Phase, str]:
        restarted = self.was_restarted()
        self.accounts.open(self.run.run_dir / "steps.jsonl", resume=restarted)
        if restarted:
            restarts = self.crew.record.note_restart(time.time(), CRASH_LOOP_WINDOW_S)
            if restarts > CRASH_LOOP_RESTARTS:
                self.pool.stop_strays(set())  # the workers its predecessors led: no controller will lead them
                return Phase.FAILED, (f"the controller restarted {restarts} times within {CRASH_LOOP_WINDOW_S:g} s: "
                                      "a crash loop, not a fault recovery can mend (its log says why it died)")
            return self.recovery.resume_after_restart()
        if self.crew.planner is not None:
            self.events.record("plan", "the planner lays out the devices the workers get", valid_sizes=list(self.sizes))
            return Phase.STARTING, "layout planned once the workers are up"
        self.events.record("plan", f"layout {self.crew.layout.describe()}", valid_sizes=list(self.sizes))
        return Phase.STARTING, f"layout {self.crew.layout.describe()}"

    def start(self) -> tuple[Phase, str]:
        wanted = self.resizer.target_workers
        room = self.pool.free_devices() - wanted
        started = self.pool.start(wanted, self.speeds)
        if self.elastic.num_spares and room > 0:  # alongside the members: warm before the first failure
            self.crew.add_spares(self.pool.start(min(self.elastic.num_spares, room)))
        members = self.pool.ready(started, self.scaling.placement_timeout_s)
        if len(members) < wanted:
            self.pool.stop(started + self.crew.spares)
            return Phase.FAILED, f"only {len(members)} of {wanted} workers started"
        try:
            self.crew.regroup(self.pool.by_locality(members), None, self.accounts.next_step)
        except Exception as error:  # a member died or fell silent before the first group formed
            return self._start_over(started, error)
        if self.crew.planner is not None:  # grow back to what the planner chose on full capacity
            self.resizer.target_workers = len(self.crew.members)
        self.events.record("start", f"{len(members)} workers", train_devices=len(members))
        return Phase.RUNNING, "workers up"

    def _start_over(self, started: list[Worker], error: Exception) -> tuple[Phase, str]:
        """Nothing was trained yet: stop the workers and spares started for the first group and start
        afresh, a few times (a busy host can hold a joining worker silent; a dead one is not coming)."""
        self.pool.abandon(started, self.crew.generation)
        spares = list(self.crew.spares)
        self.pool.stop(started + spares)
        self.crew.take_spares(spares)
        failures = self.crew.regroup_failed()
        if failures > MAX_REGROUP_RETRIES:
            return Phase.FAILED, f"the first group failed to form {failures} times; the last time: {error}"
        self.events.record("start", f"the first group did not form ({error}); starting it again", train_devices=0)
        return Phase.STARTING, f"starting again: {error}"
