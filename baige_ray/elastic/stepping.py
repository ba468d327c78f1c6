"""Running the job's steps on the crew.

Each step is dispatched to every member; while nothing asks for a regroup the next one is queued
behind it, so it starts the moment this one ends instead of a controller round trip later. The
step is watched to its end (heartbeats, the hang deadline), recorded, and its state persisted or
replicated when due; a failure, and a straggler the policy evicts, are handed to recovery.
"""

from __future__ import annotations

import time

import ray

from baige_ray.api.elastic import ElasticConfig
from baige_ray.elastic.accounts import StepAccounts
from baige_ray.elastic.crew import Crew
from baige_ray.elastic.faults import FaultPlan
from baige_ray.elastic.machine import Phase
from baige_ray.elastic.recovery import Bounds, Recovery
from baige_ray.elastic.sizing import replica_size
from baige_ray.elastic.state_sources import StateSources
from baige_ray.elastic.watch import StepOutcome, WatchTimes, watch_step
from baige_ray.ops.events import EventLog
from baige_ray.policies.straggler import StragglerAction, StragglerObservation, decide_straggler


TOLERANCE_LOG_INTERVAL_S = 60.0


class StepRunner:
    def __init__(self, crew: Crew, state_sources: StateSources, accounts: StepAccounts, recovery: Recovery,
                 events: EventLog, faults: FaultPlan, elastic: ElasticConfig, bounds: Bounds):
        self.crew, self.state_sources, self.accounts, self.recovery = crew, state_sources, accounts, recovery
        self.events, self.faults, self.elastic, self.bounds = events, faults, elastic, bounds
        self._inflight: list[ray.ObjectRef] | None = None  # the next step, already queued on every worker
        self._last_completion: float | None = None
        self._dispatched_at = 0.0
        self._tolerance_said_at: dict[int, float] = {}  # rank -> when a straggler left in place was last logged

    @property
    def between_steps(self) -> bool:
        """No step is queued ahead: the loop may finish, resize or take commands now."""
        return self._inflight is None

    def run(self, step: int, run_ahead: bool) -> tuple[Phase, str] | None:
        """Run step `step` (already queued, or dispatched now), queueing `step + 1` behind it if
        `run_ahead`; the phase to go to if it failed or a straggler is evicted, else None."""
        refs = self._inflight or self._dispatch(step)
        self._inflight = self._dispatch(step + 1, in_flight=refs) if run_ahead else None
        failed = self._complete(step, refs)
        if failed is not None:
            return failed
        evicted = self._straggler_to_evict()
        if evicted is None:
            return None
        drained = self._drain(step + 1)  # the step queued behind this one completes first
        if drained is not None:  # it failed: recovering from that takes the straggler out too, or not
            return drained
        self.recovery.evict(*evicted)
        return Phase.RECOVERING, f"straggler rank {evicted[0]}"

    def _drain(self, step: int) -> tuple[Phase, str] | None:
        if self._inflight is None:
            return None
        refs, self._inflight = self._inflight, None
        return self._complete(step, refs)

    def _dispatch(self, step: int, in_flight: list | None = None) -> list[ray.ObjectRef]:
        """Queue step `step` on every member, once the replicas have caught up (or the step `in_flight`,
        the one before it, failed: then the failure is seen at once, and `step` is refused by the workers)."""
        self.state_sources.await_replicas(step, self.accounts.next_step - self.accounts.generation_steps,
                                          min(self.accounts.deadline_s(), self.elastic.heartbeat_timeout_s), in_flight)
        due = self.faults.arm(step)
        timeout = self.accounts.deadline_s() if self.accounts.warm else None
        persist_to = self.state_sources.persist_target(step, self.crew.layout)
        snapshot = step % self.elastic.snapshot_every == 0 or persist_to is not None
        self._dispatched_at = time.monotonic()
        return [
            worker.actor.elastic_step.remote(step, snapshot=snapshot, fault=due.get(rank), collective_timeout_s=timeout,
                                             persist_to=persist_to)
            for rank, worker in enumerate(self.crew.members)
        ]

    def _complete(self, step: int, refs: list[ray.ObjectRef]) -> tuple[Phase, str] | None:
        """Watch step `step` to its end; record it, or hand the failure to recovery."""
        began = time.monotonic() if self._last_completion is None else max(self._last_completion, self._dispatched_at)
        times = WatchTimes(self.accounts.deadline_s(), self.elastic.heartbeat_interval_s,
                           self.elastic.heartbeat_timeout_s)
        outcome = watch_step(self.crew.members, refs, times, exited=self.crew.pool.exited)
        if not outcome.ok:
            self._inflight, self._last_completion = None, None  # queued behind a failed step; workers refuse it
            self.recovery.step_failed(outcome, step, began)
            return Phase.RECOVERING, describe_failure(outcome)
        self._last_completion = time.monotonic()
        members, layout = self.crew.members, self.crew.layout
        places = [(worker.info.node_id[:12], worker.info.device_index) for worker in members]
        stages = [layout.coords(rank).pp for rank in range(len(members))]
        self.accounts.record(step, outcome.metrics, self._last_completion - began, places, stages)
        self.recovery.step_recorded(step)
        self.state_sources.persist_if_due(step, members, layout)
        self.state_sources.replicate_if_due(step, members, layout, self.crew.ready_spares())
        return None

    def _straggler_to_evict(self) -> tuple[int, str] | None:
        """(rank, why) of a rank the straggler policy evicts; None to tolerate every rank."""
        if not self.elastic.evict_stragglers or len(self.crew.members) < 2:
            return None
        decision = decide_straggler(StragglerObservation(
            compute_s=tuple(self.accounts.compute_history),
            threshold=self.elastic.straggler_threshold,
            patience=self.elastic.straggler_patience,
            num_spares=len(self.crew.ready_spares()),
            min_workers=self.bounds.min_workers,
            replica_size=replica_size(self.crew.layout),
            valid_sizes=self.bounds.sizes,
            step_s=self.accounts.recent_step_s(self.elastic.straggler_patience),
        ))
        if decision.action is StragglerAction.TOLERATE:
            if decision.rank is not None:
                self._say_tolerated(decision.rank, decision.reason)
            return None
        self.events.record("straggler", decision.reason, rank=decision.rank, action=decision.action.value)
        self.accounts.forget_compute_times()
        return decision.rank, decision.reason


    def _say_tolerated(self, rank: int, reason: str) -> None:
        """Log a persistent straggler the policy leaves in place, and why, at most once a minute per rank:
        a slow rank that is never evicted must be visible in the events, not only in the step times."""
        now = time.monotonic()
        if now - self._tolerance_said_at.get(rank, -TOLERANCE_LOG_INTERVAL_S) >= TOLERANCE_LOG_INTERVAL_S:
            self._tolerance_said_at[rank] = now
            self.events.record("straggler", reason, rank=rank, action=StragglerAction.TOLERATE.value)


def describe_failure(outcome: StepOutcome) -> str:
    lost = ", ".join(f"rank {rank}: {why}" for rank, why in sorted(outcome.lost.items()))
    return lost or f"{len(outcome.failed)} rank(s) failed their step"
