"""Recovery: from a lost, failed, hung or evicted rank back to a training group.

The controller hands it what went wrong (a failed step, an eviction, its own restart); `recover`
confirms who is gone, finds the newest state every rank can be restored from, asks the failure
policy whether to replace, shrink, wait or fail, and has the crew regroup. The step after that
closes the recovery with its figures.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from baige_ray.elastic.accounts import StepAccounts
from baige_ray.elastic.crew import Crew
from baige_ray.elastic.machine import Phase
from baige_ray.elastic.state_sources import StateSources, answers_or_none, settle_parts
from baige_ray.elastic.watch import StepOutcome
from baige_ray.elastic.workers import MemberSilent, Worker, WorkerPool
from baige_ray.ops.events import EventLog
from baige_ray.policies.failure import FailureAction, FailureDecision, FailureObservation, decide_failure

MAX_REGROUP_RETRIES = 3
# Regroups that failed in a row, each losing a member, before the job fails: something that fails every
# regroup (a full disk under Ray's object store, a broken node) would otherwise replace workers forever.
MAX_FAILED_REGROUPS = 10


@dataclass(frozen=True)
class Bounds:
    """What the failure policy may choose between: the sizes the job runs at and how many recoveries it allows."""

    min_workers: int
    sizes: tuple[int, ...]
    max_recoveries: int
    placement_timeout_s: float


@dataclass
class Loss:
    """The RECOVERING phase's payload: which ranks are gone and why, and which of them still answer."""

    lost: dict[int, str]
    kind: str  # "failure" or "eviction": the event each lost rank is recorded under
    failed: set[int] = field(default_factory=set)  # alive, but their step raised: they answered just now
    readable: set[int] = field(default_factory=set)  # lost ranks whose snapshots can still be read


class Recovery:
    def __init__(self, crew: Crew, pool: WorkerPool, state_sources: StateSources, accounts: StepAccounts,
                 events: EventLog, bounds: Bounds):
        self.crew, self.pool, self.state_sources = crew, pool, state_sources
        self.accounts, self.events, self.bounds = accounts, events, bounds
        self.history: list[dict] = []  # one record per finished recovery
        self.loss: Loss | None = None
        self.started: float | None = None  # when the trouble began (the failed step's start)
        self._failed_step: int | None = None
        self._failed_step_metrics: list[dict | None] = []  # what the survivors of the failed step reported
        self._restarted = False  # steps the controller did not see are read back from the workers
        self._redo_steps = 0
        self._marks: dict[str, float] = {}  # when each phase of the recovery ended

    # ----- what went wrong -----

    def step_failed(self, outcome: StepOutcome, step: int, began: float) -> None:
        self.loss = Loss(dict(outcome.lost), "failure", failed=set(outcome.failed), readable=set(outcome.wedged))
        if self._failed_step is None:  # a second failure before the recovery ends keeps the first
            self._failed_step, self._failed_step_metrics = step, outcome.metrics
        self.started = self.started or began

    def evict(self, rank: int, why: str) -> None:
        """A straggler leaves; it still answers, so its snapshot is read before it is stopped."""
        self.loss = Loss({rank: why}, "eviction", readable={rank})  # a step failing while draining replaces it
        self.started = self.started or time.monotonic()

    def resume_after_restart(self) -> tuple[Phase, str]:
        """This controller replaced a dead one: find the workers its predecessor led and recover the rest."""
        saved = self.crew.record.load()
        if saved is None:
            return Phase.STARTING, "restarted before any worker group formed"
        members = [self.pool.find(m.name, m.speed, m.share) for m in saved.members]
        lost = {rank: "gone when the controller restarted" for rank, w in enumerate(members) if w.info is None}
        # Spares the dead controller started are not in the record: they would hold devices for good.
        strays = self.pool.stop_strays({m.name for m in saved.members})
        self.crew.assume(members, layout=saved.layout, generation=saved.generation)
        self.loss = Loss(lost, "failure")
        self.started, self._restarted = time.monotonic(), True
        self.events.record("controller_restart", f"found {len(members) - len(lost)} of {len(members)} workers",
                           stopped_strays=strays)
        return Phase.RECOVERING, "controller restarted"

    # ----- recovering -----

    def recover(self) -> tuple[Phase, str]:
        loss, self.loss = self.loss or Loss({}, "failure"), None
        marks = {"detected": time.monotonic()}
        self._abort_queued_steps(loss)
        self._confirm_the_rest(loss)
        marks["confirmed"] = time.monotonic()
        self.crew.drop_dead_spares()  # before the state is chosen: a spare may read a shelf for it
        marks["spares_checked"] = time.monotonic()
        members = self.crew.members
        survivors = [(rank, w) for rank, w in enumerate(members) if rank not in loss.lost]
        step, state = self._newest_state(loss, survivors)
        marks["gathered"] = time.monotonic()
        decision = self._decide(loss, marks)
        if decision.action is FailureAction.FAIL:
            return Phase.FAILED, decision.reason
        regrouped = self._members_after_loss(decision, loss.lost, survivors)
        if regrouped is None:
            return Phase.FAILED, f"{decision.reason}; no capacity came back within {self.bounds.placement_timeout_s:g}s"
        marks["decided"] = time.monotonic()
        try:
            self.crew.regroup(regrouped, state, self.accounts.next_step)
        except Exception as error:  # a member died while regrouping: recover again without it
            return self.lost_during_regroup(regrouped, error)
        marks["regrouped"] = time.monotonic()
        self.state_sources.release_shelves(state, regrouped)
        marks["shelves_released"] = time.monotonic()
        self._marks = marks
        self._resume(step, survivors)
        kind = "resize" if len(regrouped) != len(members) else "recovered"
        self.events.record(kind, decision.reason, train_devices=len(regrouped),
                           resume_step=self.accounts.next_step)
        return Phase.RUNNING, decision.reason

    def _abort_queued_steps(self, loss: Loss) -> None:
        for rank, why in sorted(loss.lost.items()):
            worker = self.crew.members[rank]
            node = worker.info.node_id if worker.info else None
            self.events.record(loss.kind, why, rank=rank, node_id=node, step=self.accounts.next_step)
        if loss.kind == "failure":  # survivors may be inside a step queued behind the failed one
            for rank, worker in enumerate(self.crew.members):
                if rank not in loss.lost and worker.actor is not None:
                    worker.actor.abort_step.remote()

    def _confirm_the_rest(self, loss: Loss) -> None:
        """A node's loss reaches its workers one by one: confirm those not heard from just now are still there."""
        candidates = [(rank, w) for rank, w in enumerate(self.crew.members)
                      if rank not in loss.lost and rank not in loss.failed and w.actor is not None]
        for (rank, worker), alive in zip(candidates, self.pool.responsive([w for _, w in candidates])):
            if not alive:
                loss.lost[rank] = "did not answer after a peer failed"
                self.events.record("failure", loss.lost[rank], rank=rank, node_id=worker.info.node_id,
                                   step=self.accounts.next_step)

    def _newest_state(self, loss: Loss, survivors: list[tuple[int, Worker]]):
        """(step, state parts) of the newest snapshot every rank can be restored from. Lost ranks that still
        answer (wedged, evicted) hand over their in-memory snapshots before they are stopped; their
        shelves, like the dead ranks', are read afterwards by a worker that stays on their node, or by a
        reader started there."""
        members = self.crew.members
        departing = [(rank, members[rank]) for rank in sorted(loss.readable & set(loss.lost))]
        replicas = self.state_sources.readable_replicas(members, loss.lost, loss.readable)
        step, state = self.state_sources.newest_snapshot(survivors, self.crew.layout, replicas,
                                                         members=list(enumerate(members)),
                                                         spares=self.crew.ready_spares(), leaving=departing)
        settle_parts(state)
        return step, state

    def _decide(self, loss: Loss, marks: dict[str, float]) -> FailureDecision:
        self.pool.stop([self.crew.members[rank] for rank in loss.lost])
        marks["stopped"] = time.monotonic()
        ready = self.crew.ready_spares()
        if len(ready) < len(loss.lost) and len(self.crew.spares) > len(ready):
            # Spares still starting are worth a short wait: the alternative is shrinking.
            self.pool.ready(self.crew.spares, min(10.0, self.bounds.placement_timeout_s))
        marks["spares_ready"] = time.monotonic()
        return decide_failure(FailureObservation(
            num_workers=len(self.crew.members),
            num_lost=len(loss.lost),
            num_spares=len(self.crew.ready_spares()),
            min_workers=self.bounds.min_workers,
            valid_sizes=self.bounds.sizes,
            recoveries_so_far=len(self.history),
            max_recoveries=self.bounds.max_recoveries,
        ))

    def _members_after_loss(self, decision: FailureDecision, lost: dict[int, str],
                            survivors: list[tuple[int, Worker]]) -> list[Worker] | None:
        if decision.action is FailureAction.REPLACE:
            members = list(self.crew.members)
            spares = self.crew.ready_spares()
            for rank in sorted(lost):  # spares take the lost ranks, so every other rank keeps its data slice
                members[rank] = spares.pop(0)
                self.crew.take_spares([members[rank]])
            return members
        kept = [worker for _, worker in survivors]
        needed = decision.num_workers - len(kept)
        if decision.action is FailureAction.WAIT:
            needed = self.bounds.min_workers - len(kept)
        extra = self.crew.take_or_start(needed)
        if extra is None:
            return None
        ordered = WorkerPool.by_locality(kept + extra)
        size = decision.num_workers if decision.action is FailureAction.SHRINK else len(ordered)
        leftover = ordered[size:]  # survivors beyond a valid size wait as warm spares; harvest ranks leave
        self.crew.add_spares([w for w in leftover if w.share >= 1])
        self.pool.stop([w for w in leftover if w.share < 1])
        return ordered[:size]

    def lost_during_regroup(self, members: list[Worker], error: Exception,
                            released: tuple[Worker, ...] = ()) -> tuple[Phase, str]:
        """A regroup of `members` failed part way (here or in a resize): recover again from the generation
        that last formed (its snapshots match its layout), without those of it that are gone. Workers
        that were joining it (spares, growth) go back to the spares if they still answer. `released`:
        members a failed shrink let go, gone by its choice, not lost."""
        formed = list(self.crew.members)
        joining = [w for w in members if w.name not in {f.name for f in formed}]
        # Heartbeats, not pings: the living may still be blocked in the failed rendezvous. Members the
        # regroup found silent are not waited for again.
        silent = set(error.names) if isinstance(error, MemberSilent) else set()
        asked = [w for w in formed + joining if w.name not in silent]
        answered = {name: False for name in silent} | dict(zip((w.name for w in asked),
                                                               self.pool.responsive(asked, timeout_s=2.0)))
        let_go = {w.name for w in released}
        lost = f"lost while regrouping ({type(error).__name__})"
        dead = {rank: "released by the shrink" if worker.name in let_go else lost
                for rank, worker in enumerate(formed) if not answered[worker.name]}
        # The living may wait for the dead to arrive: free them before the next regroup queues behind.
        self.pool.abandon([w for w in formed + joining if answered[w.name]], self.crew.generation)
        self.crew.add_spares([w for w in joining if answered[w.name] and w.share >= 1])
        self.pool.stop([w for w in joining if not answered[w.name] or w.share < 1])
        failures = self.crew.regroup_failed()
        if not dead and failures > MAX_REGROUP_RETRIES:
            return Phase.FAILED, f"regrouping failed {failures} times with every worker alive: {error}"
        if failures > MAX_FAILED_REGROUPS:
            return Phase.FAILED, f"regrouping failed {failures} times in a row; the last time: {error}"
        # With everyone alive the rendezvous itself failed (e.g. it waited on a member that died
        # meanwhile, then timed out): the same members try again.
        self.loss = Loss(dead, "failure")
        # From a resize no failure started a recovery: this one starts now, and is recorded when it ends.
        self.started = self.started or time.monotonic()
        return Phase.RECOVERING, f"regrouping failed: {error}"

    # ----- where training resumes -----

    def _resume(self, snapshot_step: int | None, survivors: list[tuple[int, Worker]]) -> None:
        failed_step = self._failed_step
        furthest = self._furthest_started_step(survivors, failed_step)
        next_step = self.accounts.next_step
        resumed = self.accounts.resume_after(snapshot_step)
        # Steps after an older snapshot (a replica, a persisted checkpoint) are done again: keep the redo.
        # Without a failed step (a regroup or a restart failed between steps) those are the steps done since.
        self._redo_steps = max(0, next_step - resumed) if furthest is None else max(0, furthest - resumed + 1)
        if self._restarted:
            self._recover_history(survivors)
        if failed_step is not None and resumed > failed_step:
            # The lost worker died after finishing the step, before its result arrived (kept from the
            # failure itself: a regroup that failed since then brings no step results).
            self.accounts.record_unreported(self._failed_step_metrics, failed_step)

    def _recover_history(self, survivors: list[tuple[int, Worker]]) -> None:
        """Record the steps the workers finished while no controller was there to see them."""
        self._restarted = False
        missing = self.accounts.unlogged_steps(self.accounts.next_step)
        if not missing:
            return
        asked = [w.actor.recent_metrics.remote() for _, w in survivors]
        recent = [answer or [] for answer in answers_or_none(asked, 10.0)]
        for step in missing:
            self.accounts.record_unreported([next((m for m in ranks if m.get("step") == step), None) for ranks in recent], step)

    @staticmethod
    def _furthest_started_step(survivors: list[tuple[int, Worker]], failed_step: int | None) -> int | None:
        """The last step any survivor began: with steps queued ahead it can be past the one being watched."""
        if failed_step is None:
            return None
        beats = [w.actor.heartbeat.remote() for _, w in survivors]
        started = [beat["step"] for beat in answers_or_none(beats, timeout_s=2.0) if beat is not None]
        return max([failed_step] + [step for step in started if step is not None])

    def step_recorded(self, step: int) -> None:
        """The first step after a recovery ended: the recovery is over, with its figures."""
        if self.started is None or self.loss is not None:
            return
        seconds = time.monotonic() - self.started
        phases = {name: round(at - self.started, 3) for name, at in self._marks.items()}
        record = {"recovery_s": seconds, "resumed_step": step, "lost_steps": self._redo_steps,
                  "phases_s": {**phases, "first_step_done": round(seconds, 3)},
                  "regroup_parts_s": dict(self.crew.last_regroup_parts)}
        self.history.append(record)
        self.started, self._failed_step = None, None
        self.accounts.metrics.recovery(seconds)
        self.events.record("recovered", f"next step done {seconds:.2f}s after the failure", **record)
