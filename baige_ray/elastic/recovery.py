"""The elastic controller's acting half: recover, resize, regroup, spares, finish, restart.

Split from actors/controller.py to keep each file small; only ElasticController uses it.
"""

from __future__ import annotations

import dataclasses
import json
import time

import ray
from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_get, _internal_kv_put

from baige_ray.elastic.harvest import harvest_members, harvest_regroup, whole_members
from baige_ray.elastic.machine import Phase
from baige_ray.elastic.state_sources import CALL_TIMEOUT_S, answers_or_none, settle_parts
from baige_ray.elastic.watch import StepOutcome
from baige_ray.elastic.workers import NAMESPACE, Worker, WorkerPool
from baige_ray.engines.layout import ParallelLayout
from baige_ray.engines.state import merge_weights
from baige_ray.policies.failure import FailureAction, FailureObservation, decide_failure
from baige_ray.policies.scaling import GrowthObservation, grow_to, spares_to_start

MAX_REGROUP_RETRIES = 3


class RecoveryMixin:
    # ----- recovery -----

    def _recover(self) -> tuple[Phase, str]:
        outcome, self._pending_failure = self._pending_failure, None
        marks = {"detected": time.monotonic()}
        lost = dict(outcome.lost) if outcome is not None else dict(self._evicting)
        self._evicting = {}
        failed_step = self._failed_step
        for rank, why in sorted(lost.items()):
            worker = self.members[rank]
            node = worker.info.node_id if worker.info else None
            self.events.record("failure" if outcome is not None else "eviction", why, rank=rank, node_id=node, step=self.step)
        if outcome is not None:  # survivors may be inside a step queued behind the failed one
            for rank, worker in enumerate(self.members):
                if rank not in lost and worker.actor is not None:
                    worker.actor.abort_step.remote()
        answered = set(outcome.failed) if outcome is not None else set()
        candidates = [(rank, w) for rank, w in enumerate(self.members)
                      if rank not in lost and rank not in answered and w.actor is not None]
        # A node's loss reaches its workers one by one: confirm those not heard from just now are still there.
        for (rank, _), alive in zip(candidates, WorkerPool.responsive([w for _, w in candidates])):
            if not alive:
                lost[rank] = "did not answer after a peer failed"
                self.events.record("failure", lost[rank], rank=rank, node_id=self.members[rank].info.node_id,
                                   step=self.step)
        marks["confirmed"] = time.monotonic()
        survivors = [(rank, w) for rank, w in enumerate(self.members) if rank not in lost]
        # Wedged and evicted ranks still answer: read their snapshots and replicas before stopping them.
        readable = set(outcome.wedged) if outcome is not None else set(lost)
        departing = [(rank, self.members[rank]) for rank in sorted(readable & set(lost))]
        replicas = self.state_sources.readable_replicas(self.members, lost, readable)
        step, state = self.state_sources.newest_snapshot(survivors + departing, self.layout, replicas,
                                                         members=list(enumerate(self.members)))
        settle_parts(state)
        marks["gathered"] = time.monotonic()
        self._drop_dead_spares()
        marks["spares_checked"] = time.monotonic()
        self.pool.stop([self.members[rank] for rank in lost])
        marks["stopped"] = time.monotonic()
        if len(self.pool.ready(self.spares)) < len(lost) and len(self.spares) > len(self.pool.ready(self.spares)):
            # Spares still starting are worth a short wait: the alternative is shrinking.
            self.pool.ready(self.spares, min(10.0, self.scaling.placement_timeout_s))
        marks["spares_ready"] = time.monotonic()
        decision = decide_failure(FailureObservation(
            num_workers=len(self.members),
            num_lost=len(lost),
            num_spares=len(self.pool.ready(self.spares)),
            min_workers=self.min_workers,
            valid_sizes=self.sizes,
            recoveries_so_far=len(self.recoveries),
            max_recoveries=self.elastic.max_recoveries,
        ))
        if decision.action is FailureAction.FAIL:
            return Phase.FAILED, decision.reason
        members = self._members_after_loss(decision, lost, survivors)
        if members is None:
            return Phase.FAILED, f"{decision.reason}; no capacity came back within {self.scaling.placement_timeout_s:g}s"
        marks["decided"] = time.monotonic()
        try:
            self._regroup(members, state)
        except Exception as error:  # a member died while regrouping: recover again without it
            return self._lost_during_regroup(members, error)
        self.state_sources.release_shelves(state, members)
        marks["regrouped"] = time.monotonic()
        self._recovery_marks = marks
        self._resume_at(step, self._furthest_started_step(survivors, failed_step))
        if self._restarted:
            self._recover_history(survivors)
        if failed_step is not None and self.step > failed_step:
            # The lost worker died after finishing the step, before its result arrived (kept from the
            # failure itself: a regroup that failed since then brings no step results).
            self._record_unreported(self._failed_step_metrics, failed_step)
        self.events.record("resize" if len(members) != len(survivors) + len(lost) else "recovered", decision.reason,
                           train_devices=len(members), infer_devices=0, resume_step=self.step)
        return Phase.RUNNING, decision.reason

    def _members_after_loss(self, decision, lost: dict, survivors: list) -> list[Worker] | None:
        if decision.action is FailureAction.REPLACE:
            members = list(self.members)
            spares = self.pool.ready(self.spares)
            for rank in sorted(lost):  # spares take the lost ranks, so every other rank keeps its data slice
                members[rank] = spares.pop(0)
                self.spares.remove(members[rank])
            return members
        kept = [worker for _, worker in survivors]
        needed = decision.num_workers - len(kept)
        if decision.action is FailureAction.WAIT:
            needed = self.min_workers - len(kept)
        extra = self._take_or_start(needed)
        if extra is None:
            return None
        ordered = WorkerPool.by_locality(kept + extra)
        size = decision.num_workers if decision.action is FailureAction.SHRINK else len(ordered)
        leftover = ordered[size:]  # survivors beyond a valid size wait as warm spares; harvest ranks leave
        self.spares.extend(w for w in leftover if w.share >= 1)
        self.pool.stop([w for w in leftover if w.share < 1])
        return ordered[:size]

    def _take_or_start(self, count: int) -> list[Worker] | None:
        """`count` ready workers: warm spares first, then new actors (waiting for them to start)."""
        if count <= 0:
            return []
        self._drop_dead_spares()
        taken = self.pool.ready(self.spares)[:count]
        for worker in taken:
            self.spares.remove(worker)
        started = self.pool.start(count - len(taken))
        up = self.pool.ready(started, self.scaling.placement_timeout_s) if started else []
        if len(taken) + len(up) < count:
            self.pool.stop(taken + started)
            return None
        return taken + up

    def _drop_dead_spares(self) -> None:
        """Forget ready spares that no longer answer (spares still starting are left alone)."""
        ready = self.pool.ready(self.spares)
        dead = [w for w, alive in zip(ready, WorkerPool.responsive(ready)) if not alive]
        self.pool.stop(dead)
        self.spares = [w for w in self.spares if w not in dead]

    def _lost_during_regroup(self, members: list[Worker], error: Exception) -> tuple[Phase, str]:
        # Heartbeats, not pings: the living may still be blocked in the failed rendezvous.
        answered = WorkerPool.responsive(members, timeout_s=2.0)
        dead = {rank: f"lost while regrouping ({type(error).__name__})"
                for rank, alive in enumerate(answered) if not alive}
        # The living may wait for the dead to arrive: free them before the next regroup queues behind.
        WorkerPool.abandon([w for w, alive in zip(members, answered) if alive], self.generation)
        self.members = members
        self._regroup_failures += 1
        if not dead and self._regroup_failures > MAX_REGROUP_RETRIES:
            return Phase.FAILED, f"regrouping failed {self._regroup_failures} times with every worker alive: {error}"
        # With everyone alive the rendezvous itself failed (e.g. it waited on a member that died
        # meanwhile, then timed out): the same members try again.
        self._pending_failure = StepOutcome(metrics=[], lost=dead)
        return Phase.RECOVERING, f"regrouping failed: {error}"

    def _recover_history(self, survivors: list[tuple[int, Worker]]) -> None:
        """Record the steps the workers finished while no controller was there to see them."""
        self._restarted = False
        logged = {m["step"] for m in self.metrics}
        missing = [step for step in range(self.step) if step not in logged]
        if not missing:
            return
        asked = [w.actor.recent_metrics.remote() for _, w in survivors]
        recent = [answer or [] for answer in answers_or_none(asked, 10.0)]
        for step in missing:
            self._record_unreported([next((m for m in ranks if m.get("step") == step), None) for ranks in recent], step)

    @staticmethod
    def _furthest_started_step(survivors: list[tuple[int, Worker]], failed_step: int | None) -> int | None:
        """The last step any survivor began: with steps queued ahead it can be past the one being watched."""
        if failed_step is None:
            return None
        beats = [w.actor.heartbeat.remote() for _, w in survivors]
        started = [beat["step"] for beat in answers_or_none(beats, timeout_s=2.0) if beat is not None]
        return max([failed_step] + [step for step in started if step is not None])

    def _resume_at(self, snapshot_step: int | None, failed_step: int | None) -> None:
        self.step = 0 if snapshot_step is None else snapshot_step + 1
        # Steps after an older snapshot (a replica, a persisted checkpoint) are done again: keep the redo.
        self.step_log.keep_before(self.step)
        self._redo_steps = 0 if failed_step is None else max(0, failed_step - self.step + 1)

    def _finish_recovery(self, seconds: float) -> None:
        record = {"recovery_s": seconds, "resumed_step": self.step, "lost_steps": self._redo_steps}
        marks, began = self._recovery_marks, self._recovery_started
        record["phases_s"] = {name: round(at - began, 3) for name, at in marks.items()}
        self.recoveries.append(record)
        self._recovery_started = None
        self._failed_step = None
        self.job_metrics.recovery(seconds)
        self._start_spares(self.elastic.num_spares - len(self.spares))  # after the step: off the critical path
        self.events.record("recovered", f"next step done {seconds:.2f}s after the failure", **record)

    # ----- resize -----

    def _resize(self) -> tuple[Phase, str]:
        if self._harvest_request is not None:
            return self._reharvest()
        requested, self._resize_request = self._resize_request, None
        if self.planner is not None:
            return self._resize_planned(requested if requested is not None else self._growth_target())
        target = requested if requested is not None else self._growth_target()
        reason = self._resize_reason or "capacity came back"
        self._resize_reason = ""
        whole, harvest = whole_members(self.members), harvest_members(self.members)
        before = len(whole)
        if target != before:
            released: list[Worker] = []
            if target < before:
                members, released = WorkerPool.by_locality(whole[:target] + harvest), whole[target:]
            else:
                extra = self._take_or_start(target - before)
                members = WorkerPool.by_locality(self.members + (extra or []))
            failed = self._switch_to(members, released)
            if failed is not None:
                return failed
            self.events.record("resize", reason or f"{before} -> {len(members)} workers",
                               train_devices=len(members), infer_devices=0, resume_step=self.step)
        self._resize_done.set()
        return Phase.RUNNING, f"{before} -> {len(self.members)} workers"

    def _reharvest(self) -> tuple[Phase, str]:
        """Regroup with the requested harvest ranks: the new ones (already up) join, surplus ones leave."""
        request, self._harvest_request = self._harvest_request, None
        members, released = harvest_regroup(self.members, request)
        before = len(self.members)
        if len(members) != before or released:
            failed = self._switch_to(members, released)
            if failed is not None:
                return failed
            harvested = len(harvest_members(self.members))
            self.events.record("harvest", request.reason or f"{harvested} rank(s) beside replicas",
                               train_devices=len(whole_members(self.members)), harvested_devices=harvested,
                               resume_step=self.step)
        self._resize_done.set()
        return Phase.RUNNING, f"{before} -> {len(self.members)} ranks, {len(harvest_members(self.members))} harvesting"

    def _switch_to(self, members: list[Worker], released: list[Worker]) -> tuple[Phase, str] | None:
        """Regroup `members` from the current members' newest snapshot, then stop `released` (after the
        regroup read their snapshots; it frees their devices). A failure goes to recovery: its phase."""
        step, state = self.state_sources.newest_snapshot(list(enumerate(self.members)), self.layout)
        try:
            self._regroup(members, state)
        except Exception as error:
            self._resize_done.set()
            self.pool.stop(released)
            return self._lost_during_regroup(members, error)
        self.state_sources.release_shelves(state, members)  # the released remove their own, then go
        self.pool.stop(released)
        self._resume_at(step, None)
        return None

    def _resize_planned(self, devices: int) -> tuple[Phase, str]:
        """Hold `devices` devices (workers and idle spares) and let the planner lay out all of them."""
        reason = self._resize_reason or "capacity came back"
        self._resize_reason = ""
        before = self.layout.describe()
        self._drop_dead_spares()
        ready = self.pool.ready(self.spares)
        held = self.members + ready
        extra = self._take_or_start(devices - len(held)) if devices > len(held) else []
        keep, released = held[:devices], held[devices:]  # members first: they already hold the state
        self.spares = [w for w in self.spares if w not in ready]
        failed = self._switch_to(WorkerPool.by_locality(keep + (extra or [])), released)
        if failed is not None:
            return failed
        self.events.record("resize", reason, train_devices=len(self.members), infer_devices=0, resume_step=self.step)
        self._resize_done.set()
        return Phase.RUNNING, f"{before} -> {self.layout.describe()}"

    def _growth_target(self) -> int:
        """Grow from warm spares only; start spares on free devices so they are warm by the next check."""
        ready = len(self.pool.ready(self.spares))
        missing = self.target_workers - len(whole_members(self.members)) - len(self.spares)
        self._start_spares(missing)
        if self.planner is not None:
            return self._planned_growth()
        harvesting = len(harvest_members(self.members))
        return grow_to(GrowthObservation(  # in whole workers: sizes less the harvest ranks beside them
            num_workers=len(whole_members(self.members)),
            target_workers=self.target_workers,
            free_devices=0,
            num_spares=ready,
            valid_sizes=tuple(size - harvesting for size in self.sizes if size > harvesting),
        ))

    def _planned_growth(self) -> int:
        """How many devices the planner would hold with every ready spare added (current ones if no more).

        Planned once per set of candidates: a planner that prefers fewer devices is not asked again
        until a spare comes or goes."""
        candidates = self.members + self.pool.ready(self.spares)
        key = frozenset(w.name for w in candidates)
        if key != self._growth_key:
            self._growth_key = key
            try:
                used = len(self.planner.arrange(candidates).members)
            except LookupError:  # a new node not in the graph yet: look again next time
                self._growth_key, used = None, len(self.members)
            self._growth_devices = len(candidates) if used > len(self.members) else len(self.members)
        return self._growth_devices

    def _start_spares(self, wanted: int) -> None:
        if wanted <= 0:
            return
        count = spares_to_start(wanted, 0, self.pool.free_devices())
        if count:
            self.spares.extend(self.pool.start(count))

    # ----- regrouping and state -----

    def _regroup(self, members: list[Worker], state_parts: list[ray.ObjectRef] | None) -> None:
        arrangement = self.planner.arrange(members) if self.planner is not None else None
        if arrangement is not None:
            members, layout = list(arrangement.members), arrangement.layout
        else:
            layout = self.layout_for(len(members))
        self.generation += 1
        reports = WorkerPool.regroup(members, self.generation, self.job, layout, state_parts or [], CALL_TIMEOUT_S,
                                     faults=self.faults.arm_regroup(self.step))
        if arrangement is not None:
            self.planner.commit(arrangement)
            self.spares.extend(arrangement.unused)
            self.events.record("plan", arrangement.describe(), repaired=arrangement.repaired,
                               reshard=arrangement.reshard, step_time_s=arrangement.plan.step_time_s)
        # One rank per pipeline stage counts its stage's parameters (DTensor counts are global).
        self.num_parameters = sum(
            report["num_parameters"] for rank, report in enumerate(reports)
            if layout.coords(rank).dp == 0 and layout.coords(rank).tp == 0
        )
        self.members, self.layout = members, layout
        self._generation_steps = 0
        self._regroup_failures = 0
        self._save_job_record()

    # ----- the end, and a restarted controller -----

    def _finish(self) -> dict:
        result = {"phase": self.machine.phase.value, "metrics": self.metrics, "recoveries": self.recoveries,
                  "layout": self.layout.describe(), "workers": [w.info for w in self.members],
                  "elapsed_s": time.time() - self.started_at, "checkpoint_path": None, "status": self.status()}
        if self.machine.phase is Phase.FINISHED and self.members:
            # Weights only: Adam's moments would triple what every owner gathers, and the final
            # directory keeps weights (snapshots and persisted checkpoints keep the rest).
            # Training is over: the snapshots go before the full weights are gathered, and the workers
            # before those are written and handed on; beside them they would not fit a host sized for
            # training (bench scale).
            self._discard_shelves()
            parts = ray.get([w.actor.export_weights.remote() for w in self.members], timeout=CALL_TIMEOUT_S)
            self._release_everything()
            weights = merge_weights(parts)
            del parts
            result["checkpoint_path"] = self.job.plugin.save_final(self.run_config.run_dir / "final", weights,
                                                                   step=self.step)
            result["final_state"] = ray.put({"model": weights, "optimizer": {}})
        self.state_sources.close()
        self.step_log.close()
        return result

    def _release_everything(self) -> None:
        if self._released:  # the run's end did it before writing the weights; the workers are gone
            return
        self._released = True
        incoming = self._harvest_request.incoming if self._harvest_request is not None else []
        everyone = [w for w in self.members + self.spares + incoming if w.actor is not None]
        if not self._shelves_discarded:
            self._discard_shelves()
        self.pool.stop(everyone)
        self.members, self.spares = list(self.members), []
        _internal_kv_del(self._record_key())

    def _discard_shelves(self) -> None:
        # Only members hold snapshots; a spare may still be starting, and asking it would wait for that.
        WorkerPool.discard_shelves(self.members, self.run_config.name)
        self._shelves_discarded = True

    def _record_key(self) -> str:
        return f"baige:job:{self.run_config.name}"

    def _save_job_record(self) -> None:
        record = {"workers": [w.name for w in self.members], "speeds": [w.speed for w in self.members],
                  "shares": [w.share for w in self.members],
                  "layout": dataclasses.asdict(self.layout), "generation": self.generation}
        _internal_kv_put(self._record_key(), json.dumps(record), overwrite=True)

    def _resume_after_restart(self) -> tuple[Phase, str]:
        raw = _internal_kv_get(self._record_key())
        if raw is None:
            return Phase.STARTING, "restarted before any worker group formed"
        record = json.loads(raw)
        self.layout = ParallelLayout(**{k: tuple(v) if isinstance(v, list) else v for k, v in record["layout"].items()})
        self.generation = record["generation"]
        members, lost = [], {}
        shares = record.get("shares", [1.0] * len(record["workers"]))
        for rank, (name, speed, share) in enumerate(zip(record["workers"], record["speeds"], shares)):
            members.append(self._find_worker(name, speed, share))
            if members[-1].info is None:
                lost[rank] = "gone when the controller restarted"
        self.members = members
        self._pending_failure = StepOutcome(metrics=[], lost=lost)
        self._recovery_started = time.monotonic()
        self._restarted = True
        self.events.record("controller_restart", f"found {len(members) - len(lost)} of {len(members)} workers")
        return Phase.RECOVERING, "controller restarted"

    @staticmethod
    def _find_worker(name: str, speed: float, share: float = 1.0) -> Worker:
        try:
            actor = ray.get_actor(name, namespace=NAMESPACE)
            info = ray.get(actor.device_info.remote(), timeout=10)
            return Worker(actor=actor, name=name, speed=speed, share=share, info=info)
        except Exception:
            return Worker(actor=None, name=name, speed=speed, share=share)
