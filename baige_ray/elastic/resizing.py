"""Resizing: the control thread's commands (resize, harvest, stop, allow steps) and capacity coming back.

The loop hands the resizer the commands at a step boundary; a command that changes who trains
becomes the RESIZING phase's payload and is carried out in one regroup from the members' newest
snapshot, then answered. Growth of a fixed layout waits for warm spares, so training runs while
they start; a resize that asked for it is answered once the job has grown.
"""

from __future__ import annotations

import time

from baige_ray.api.elastic import ElasticConfig
from baige_ray.elastic.accounts import StepAccounts
from baige_ray.elastic.commands import AllowSteps, Command, CommandQueue, Harvest, Pending, Resize, Stop
from baige_ray.elastic.crew import Crew
from baige_ray.elastic.harvest import harvest_members, harvest_regroup, whole_members
from baige_ray.elastic.heartbeats import Heartbeats
from baige_ray.elastic.machine import Phase
from baige_ray.elastic.recovery import Recovery
from baige_ray.elastic.state_sources import StateSources
from baige_ray.elastic.workers import Worker, WorkerPool
from baige_ray.ops.events import EventLog
from baige_ray.policies.scaling import GrowthObservation, grow_to
from baige_ray.policies.straggler import StragglerAction, slow_ranks


class Resizer:
    def __init__(self, crew: Crew, pool: WorkerPool, state_sources: StateSources, accounts: StepAccounts,
                 events: EventLog, recovery: Recovery, elastic: ElasticConfig, *, sizes: tuple[int, ...],
                 target_workers: int, steps_allowed: int | None = None):
        self.crew, self.pool, self.state_sources, self.accounts = crew, pool, state_sources, accounts
        self.events, self.recovery, self.elastic, self.sizes = events, recovery, elastic, sizes
        self.commands = CommandQueue()  # the control thread's requests; only the loop acts on them
        self.target_workers = target_workers
        self.stopping = False
        self.steps_allowed = steps_allowed  # steps below it may run; None: every step
        self._resizing: Pending | None = None  # the command the RESIZING phase carries out
        self._growth_waiters: list[Pending] = []  # Resize commands answered once growth reaches them
        self._last_growth_check = 0.0
        self._growth_key: frozenset[str] | None = None  # the workers last weighed for growth
        self._growth_devices = 0  # how many of them the planner would use
        self._last_spare_check = 0.0
        self._spare_heartbeats = Heartbeats(elastic.heartbeat_timeout_s)  # spares no step call watches

    @property
    def planned(self) -> bool:
        return self.crew.planner is not None

    # ----- commands, taken at a step boundary -----

    def take_commands(self) -> None:
        """Act on the control thread's commands until one needs a regroup (the RESIZING phase's payload)."""
        while self._resizing is None and (pending := self.commands.take()) is not None:
            command = pending.command
            if isinstance(command, Resize):
                self._take_resize(pending)
            elif isinstance(command, Harvest):
                self._resizing = pending
            elif isinstance(command, AllowSteps):
                self.steps_allowed = max(self.steps_allowed or 0, command.until)
                pending.answer.set_result(self.steps_allowed)
            else:
                self.stopping = self.stopping or isinstance(command, Stop)
                pending.answer.set_result(None)
        self._answer_growth_waiters()

    def _take_resize(self, pending: Pending) -> None:
        """A planned job regroups on the planner's choice now; a fixed layout shrinks in one regroup now
        and grows once spares for it are warm (the command is answered then)."""
        self._answer_growth_waiters(superseded=True)
        self.target_workers = pending.command.num_workers
        whole = len(whole_members(self.crew.members))
        if self.target_workers > whole:
            self.crew.end_holds()
        if self.planned or self.target_workers < whole:
            self._resizing = pending
        elif self.target_workers > whole:
            self._last_growth_check = 0.0
            self._growth_waiters.append(pending)
        else:
            pending.answer.set_result(whole)

    def _answer_growth_waiters(self, superseded: bool = False) -> None:
        whole = len(whole_members(self.crew.members))
        for pending in [p for p in self._growth_waiters if superseded or p.command.num_workers == whole]:
            self._growth_waiters.remove(pending)
            pending.answer.set_result(whole)

    def allows(self, step: int) -> bool:
        return self.steps_allowed is None or step < self.steps_allowed

    def answer_for(self, command: Command):
        """What a command's caller is told once it is carried out, or if the job ended first."""
        if isinstance(command, Resize):
            return len(whole_members(self.crew.members))
        if isinstance(command, Harvest):
            return len(harvest_members(self.crew.members))
        return None

    def close(self, why: str) -> list[Worker]:
        """Answer every command left when the loop ends; returns harvest ranks started for them."""
        left = self.commands.close(why) + self._growth_waiters + ([self._resizing] if self._resizing else [])
        self._growth_waiters, self._resizing = [], None
        for pending in left:
            pending.answer.set_result(self.answer_for(pending.command))
        return [w for p in left if isinstance(p.command, Harvest) for w in p.command.incoming]

    # ----- when to resize -----

    def due(self) -> bool:
        return self._resizing is not None or self._growth_due()

    def quiet(self) -> bool:
        """Nothing asks for a regroup before the next step: it may be queued ahead."""
        return (not self.commands and self._resizing is None and not self.stopping
                and len(whole_members(self.crew.members)) >= self.target_workers)

    def _growth_due(self) -> bool:
        now = time.monotonic()
        whole = len(whole_members(self.crew.members))
        if whole >= self.target_workers or now - self._last_growth_check < self.elastic.grow_check_interval_s:
            return False
        self._last_growth_check = now
        if self._growth_target() > whole:
            return True
        self._last_growth_check = now - self.elastic.grow_check_interval_s + 0.1  # spares starting: look again soon
        return False

    # ----- spares -----

    def keep_spares(self) -> None:
        """Top the warm spares up to num_spares on free devices, checked every grow_check_interval_s.

        Growth and recoveries use spares up and a lend can then shrink the job to its floor, where a
        straggler can only be swapped for a spare: they are refilled whenever a device is free, not
        only after a recovery. A spare that died or froze unseen (its node lost, with no member on it)
        is dropped first, and replaced."""
        now = time.monotonic()
        if not self.elastic.num_spares or now - self._last_spare_check < self.elastic.grow_check_interval_s:
            return
        self._last_spare_check = now
        self._drop_lost_spares(now)
        missing = self.elastic.num_spares - len(self.crew.spares)
        if missing > 0:
            self.crew.start_spares(missing)

    def _drop_lost_spares(self, now: float) -> None:
        ready = self.crew.ready_spares()
        lost = self._spare_heartbeats.unresponsive({w.name: w for w in ready}, now)
        gone = [w for w in ready if w.name in lost] + self.crew.never_started_spares()
        if gone:
            self.crew.drop_spares(gone)
            why = sorted({lost.get(w.name, "it never came up") for w in gone})
            self.events.record("spare_lost", f"{len(gone)} spare(s) lost: {'; '.join(why)}",
                               spares=len(self.crew.spares))

    # ----- resizing -----

    def resize(self) -> tuple[Phase, str]:
        """Carry out the command the phase carries (none: growth the periodic check found), then answer it."""
        pending, self._resizing = self._resizing, None
        command = pending.command if pending is not None else None
        if isinstance(command, Harvest):
            phase = self._reharvest(command)
        else:
            target = command.num_workers if command is not None else self._growth_target()
            waiting = self._growth_waiters[0].command.reason if self._growth_waiters else ""
            reason = (command.reason if command is not None else waiting) or "capacity came back"
            before = len(self.crew.members)
            phase = self._resize_planned(target, reason) if self.planned else self._resize_fixed(target, reason)
            if command is None and self.planned and len(self.crew.members) <= before:
                # The planner left the added devices idle: no growth from these candidates again.
                self._growth_devices = len(self.crew.members)
        if pending is not None:
            pending.answer.set_result(self.answer_for(command))
        self._answer_growth_waiters()
        return phase

    def _resize_fixed(self, target: int, reason: str) -> tuple[Phase, str]:
        whole, harvest = whole_members(self.crew.members), harvest_members(self.crew.members)
        before = len(whole)
        if target != before:
            released: list[Worker] = []
            if target < before:
                slow = self._slow_members(whole)
                kept = [w for w in whole if w not in slow] + slow  # stragglers go first, then the last ranks
                members, released = WorkerPool.by_locality(kept[:target] + harvest), kept[target:]
                self._say_released(slow, released, reason)
            else:
                extra = self.crew.take_or_start(target - before)
                members = WorkerPool.by_locality(self.crew.members + (extra or []))
            failed = self._switch_to(members, released)
            if failed is not None:
                return failed
            self.events.record("resize", reason, train_devices=len(members),
                               resume_step=self.accounts.next_step, released_pids=_pids(released))
        return Phase.RUNNING, f"{before} -> {len(self.crew.members)} workers"

    def _reharvest(self, request: Harvest) -> tuple[Phase, str]:
        """Regroup with the requested harvest ranks: the new ones (already up) join, surplus ones leave."""
        members, released = harvest_regroup(self.crew.members, request)
        before = len(self.crew.members)
        if len(members) != before or released:
            failed = self._switch_to(members, released)
            if failed is not None:
                return failed
            harvested = len(harvest_members(self.crew.members))
            self.events.record("harvest", request.reason or f"{harvested} rank(s) beside replicas",
                               train_devices=len(whole_members(self.crew.members)), harvested_devices=harvested,
                               resume_step=self.accounts.next_step)
        harvesting = len(harvest_members(self.crew.members))
        return Phase.RUNNING, f"{before} -> {len(self.crew.members)} ranks, {harvesting} harvesting"

    def _resize_planned(self, devices: int, reason: str) -> tuple[Phase, str]:
        """Hold `devices` devices (workers and idle spares) and let the planner lay out all of them."""
        before = self.crew.layout.describe()
        self.crew.drop_dead_spares()
        ready = self.crew.ready_spares()
        slow = self._slow_members(self.crew.members)
        # Members first, they already hold the state; but a straggler after the idle spares.
        held = [w for w in self.crew.members if w not in slow] + ready + slow
        extra = self.crew.take_or_start(devices - len(held)) if devices > len(held) else []
        keep, released = held[:devices], held[devices:]
        self._say_released(slow, released, reason)
        self.crew.take_spares(ready)
        failed = self._switch_to(WorkerPool.by_locality(keep + (extra or [])), released)
        if failed is not None:
            return failed
        self.events.record("resize", reason, train_devices=len(self.crew.members),
                           resume_step=self.accounts.next_step, released_pids=_pids(released))
        return Phase.RUNNING, f"{before} -> {self.crew.layout.describe()}"

    def _slow_members(self, among: list[Worker]) -> list[Worker]:
        """Members of `among` whose recent compute pace makes them stragglers (slowest first)."""
        members = self.crew.members
        ranks = slow_ranks(tuple(self.accounts.compute_history), self.elastic.straggler_threshold,
                           self.elastic.straggler_patience)
        return [members[rank] for rank in ranks if rank < len(members) and members[rank] in among]

    def _say_released(self, slow: list[Worker], released: list[Worker], reason: str) -> None:
        members = self.crew.members
        for worker in (w for w in slow if w in released):
            rank = members.index(worker)
            self.events.record("straggler", f"rank {rank} is slow; the shrink ({reason}) releases it first",
                               rank=rank, action=StragglerAction.RELEASE.value)

    def _switch_to(self, members: list[Worker], released: list[Worker]) -> tuple[Phase, str] | None:
        """Regroup `members` from the current members' newest snapshot, then stop `released` (after the
        regroup read their snapshots; it frees their devices). A failure goes to recovery: its phase."""
        formed = self.crew.members
        if not all(self.pool.responsive(formed, timeout_s=self.elastic.heartbeat_timeout_s)):
            # A frozen member (SIGSTOP, a hung host) would hold the snapshot reads and the rendezvous for
            # minutes: recovery finds it by its silence and regroups without it.
            return self.recovery.lost_during_regroup(members, RuntimeError("a member stopped answering heartbeats"))
        step, state = self.state_sources.newest_snapshot(list(enumerate(formed)), self.crew.layout)
        try:
            self.crew.regroup(members, state, self.accounts.next_step)
        except Exception as error:
            self.pool.stop(released)
            return self.recovery.lost_during_regroup(members, error, released=tuple(released))
        self.state_sources.release_shelves(state, members)  # the released remove their own, then go
        self.pool.stop(released)
        self.crew.hold_released(released)
        self.accounts.resume_after(step)
        return None

    # ----- growth -----

    def _growth_target(self) -> int:
        """Grow from warm spares only; start spares on free devices so they are warm by the next check."""
        ready = len(self.crew.ready_spares())
        whole = len(whole_members(self.crew.members))
        self.crew.start_spares(self.target_workers - whole - len(self.crew.spares))
        if self.planned:
            return self._planned_growth()
        harvesting = len(harvest_members(self.crew.members))
        return grow_to(GrowthObservation(  # in whole workers: sizes less the harvest ranks beside them
            num_workers=whole,
            target_workers=self.target_workers,
            free_devices=0,
            num_spares=ready,
            valid_sizes=tuple(size - harvesting for size in self.sizes if size > harvesting),
        ))

    def _planned_growth(self) -> int:
        """How many devices the planner would hold with every ready spare added (current ones if no more).

        Planned once per set of candidates: a planner that prefers fewer devices is not asked again
        until a spare comes or goes."""
        candidates = self.crew.members + self.crew.ready_spares()
        key = frozenset(w.name for w in candidates)
        if key != self._growth_key:
            self._growth_key = key
            try:
                used = len(self.crew.planner.arrange(candidates).members)
            except LookupError:  # a new node not in the graph yet: look again next time
                self._growth_key, used = None, len(self.crew.members)
            self._growth_devices = len(candidates) if used > len(self.crew.members) else len(self.crew.members)
        return self._growth_devices


def _pids(workers: list[Worker]) -> list[int]:
    """The processes of `workers` (those known): what an operator or a fault injector matches a release by."""
    return [w.info.pid for w in workers if w.info is not None]
