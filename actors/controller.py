"""The elastic controller: one actor per training job that owns its workers, spares and plan.

An explicit state machine (baige_ray/elastic/machine.py): each phase has one
handler that acts and returns the next phase. Policies (policies/) decide what to
do about failures, stragglers and growth; this class only acts on Ray. The
decision logic it needs is importable and testable without Ray.
"""

from __future__ import annotations

import statistics
import threading
import time
import warnings

import ray

from baige_ray.actors.worker import ElasticWorkerActor
from baige_ray.api.configs import RunConfig, ScalingConfig
from baige_ray.elastic.config import ElasticConfig
from baige_ray.elastic.faults import FaultKind, FaultPlan
from baige_ray.elastic.harvest import HarvestRequest, check_harvest, harvest_members, whole_members
from baige_ray.elastic.machine import Phase, StateMachine
from baige_ray.elastic.planning import ElasticPlanner
from baige_ray.elastic.recovery import RecoveryMixin
from baige_ray.elastic.step_log import StepLog
from baige_ray.elastic.state_sources import StateSources
from baige_ray.elastic.sizing import layout_for, replica_size, valid_sizes
from baige_ray.elastic.watch import WatchTimes, watch_step
from baige_ray.elastic.workers import Worker, WorkerPool
from baige_ray.engines.layout import ParallelLayout
from baige_ray.ops.events import EventLog
from baige_ray.ops.expert_load import expert_load, imbalance
from baige_ray.ops.metrics import JobMetrics, estimate_mfu
from baige_ray.runtime.train_loop import TrainJob
from baige_ray.runtime.worker_group import choose_device_resource
from baige_ray.policies.straggler import StragglerAction, StragglerObservation, decide_straggler

CONTROLLER_THREADS = {"max_concurrency": 1, "concurrency_groups": {"loop": 1, "control": 4}}
WARMUP_STEPS = 2  # first steps build caches; their times do not set the deadline
HARVEST_START_TIMEOUT_S = 60.0  # a harvest rank not up by then found no device share free


class ElasticController(RecoveryMixin):
    def __init__(
        self,
        job: TrainJob,
        scaling: ScalingConfig,
        run: RunConfig,
        elastic: ElasticConfig,
        layout: ParallelLayout,
        *,
        speeds: list[float] | None = None,
        faults: FaultPlan | None = None,
        worker_cls: type = ElasticWorkerActor,
        planner: ElasticPlanner | None = None,
    ):
        self.job, self.scaling, self.run_config, self.elastic = job, scaling, run, elastic
        self.layout = layout
        self.requested_layout = layout  # resizes derive from it: an EP degree cut by a shrink comes back on growth
        self.faults = faults or FaultPlan()
        self.speeds = list(speeds or [1.0] * scaling.num_workers)
        self.machine = StateMachine()
        self.events = EventLog(run.run_dir / "events.jsonl")
        self.pool = WorkerPool(scaling, run.name, choose_device_resource(scaling, ray.cluster_resources()), worker_cls,
                               snapshot_slots=self.elastic.snapshot_slots)
        self.min_workers, self.max_workers = elastic.bounds(scaling.num_workers)
        self.target_workers = scaling.num_workers
        self.planner = planner
        # The planner may use any number of the devices it is given (idle ones stay as spares).
        self.sizes = (tuple(range(self.min_workers, self.max_workers + 1)) if planner is not None
                      else valid_sizes(job, layout, self.min_workers, self.max_workers))
        self._build_runtime_state()

    def _build_runtime_state(self) -> None:
        self.members: list[Worker] = []
        self.spares: list[Worker] = []
        self.generation = -1
        self.step = 0
        self.step_log: StepLog | None = None  # opened in _plan: fresh, or read back after a restart
        self.expert_load: list[list[int]] = []  # MoE jobs: the last step's slots per expert of each layer
        self.step_times: list[float] = []
        self.compute_history: list[tuple[float, ...]] = []
        self.recoveries: list[dict] = []
        self.started_at = time.time()
        self.productive_s = 0.0
        self._pending_failure = None
        self._recovery_started: float | None = None
        self._resize_request: int | None = None
        self._harvest_request: HarvestRequest | None = None
        self._inflight: list[ray.ObjectRef] | None = None  # the next step, already queued on every worker
        self._last_completion: float | None = None
        self._dispatched_at = 0.0
        self._resize_done = threading.Event()
        self._stop_requested = False
        self._last_growth_check = 0.0
        self.state_sources = StateSources(self.elastic, self.run_config.name, self.events)
        self._failed_step: int | None = None
        self._failed_step_metrics: list[dict | None] = []  # what the survivors of the failed step reported
        self._evicting: dict[int, str] = {}  # rank -> why: a straggler being evicted
        self._released = False  # workers stopped and shelves removed: at the run's end, once
        self._shelves_discarded = False  # the run's end removes them before it gathers the weights
        self._restarted = False  # this controller replaced a dead one; steps it did not see are recovered
        self._regroup_failures = 0  # consecutive regroups that failed with every worker alive
        self._redo_steps = 0  # steps the current recovery does again
        self._recovery_marks: dict[str, float] = {}  # when each phase of the last recovery ended
        self._resize_reason = ""
        self._growth_key: frozenset[str] | None = None  # the workers last weighed for growth
        self._growth_devices = 0  # how many of them the planner would use
        self.num_parameters = 0
        self._generation_steps = 0  # steps completed since the last regroup
        self.job_metrics = JobMetrics(job=self.run_config.name)

    @property
    def metrics(self) -> list[dict]:
        return self.step_log.records if self.step_log is not None else []

    # ----- public surface (called on the controller's control thread) -----

    @ray.method(concurrency_group="loop")
    def run(self) -> dict:
        handlers = {
            Phase.PLANNING: self._plan,
            Phase.STARTING: self._start,
            Phase.RUNNING: self._run_step,
            Phase.RECOVERING: self._recover,
            Phase.RESIZING: self._resize,
        }
        try:
            while not self.machine.done:
                phase, reason = handlers[self.machine.phase]()
                self.machine.advance(phase, reason)
                if phase in (Phase.FINISHED, Phase.FAILED):
                    self.events.record(phase.value, reason, step=self.step)
            return self._finish()
        finally:
            self._release_everything()

    @ray.method(concurrency_group="control")
    def status(self) -> dict:
        elapsed = time.time() - self.started_at
        recent = self.step_times[-20:]
        return {
            "name": self.run_config.name,
            "state": self.machine.phase.value,
            "step": self.step,
            "num_steps": self.job.train.num_steps,
            "layout": self.layout.describe(),
            "num_workers": len(self.members),
            "num_harvest": len(harvest_members(self.members)),
            "num_spares": len(self.spares),
            "workers": [self._describe(rank, worker) for rank, worker in enumerate(self.members)],
            "events": self.events.recent(20),
            "steps_per_s": len(recent) / sum(recent) if recent else 0.0,
            "goodput": self.productive_s / elapsed if elapsed > 0 else 0.0,
            "started_at": self.started_at,
            "elapsed_s": elapsed,
            "recoveries": list(self.recoveries),
            "faults_fired": {kind.value: self.faults.count(kind) for kind in FaultKind},
            "replica_wait_s": round(self.state_sources.replica_copies.waited_s, 3),  # training stalled for slow replica copies
            "expert_load": self.expert_load,  # the last step's slots per expert of each MoE layer
        }

    @ray.method(concurrency_group="control")
    def resize(self, num_workers: int, reason: str = "") -> int:
        """Ask training to run on `num_workers` whole devices (plus any harvest ranks, a valid size in
        all); returns once it does."""
        harvesting = len(harvest_members(self.members))
        if num_workers + harvesting not in self.sizes:
            raise ValueError(f"num_workers={num_workers} is invalid: with {harvesting} harvest rank(s), expected "
                             f"one of {[size - harvesting for size in self.sizes if size > harvesting]}")
        self._resize_reason = reason
        self.target_workers = num_workers
        if self.planner is not None:  # one regroup either way: the planner decides how many it uses
            self._resize_done.clear()
            self._resize_request = num_workers
            while not self.machine.done and not self._resize_done.wait(0.1):
                pass
            return len(self.members)
        # Growth keeps training at its current size while the new workers start (as spares,
        # in the background), then switches in one regroup; shrinking is one regroup now.
        self._last_growth_check = 0.0
        while not self.machine.done and len(whole_members(self.members)) != num_workers:
            if num_workers < len(whole_members(self.members)) and self._resize_request is None:
                self._resize_done.clear()
                self._resize_request = num_workers
            self._resize_done.wait(0.1)
        return len(whole_members(self.members))

    @ray.method(concurrency_group="control")
    def harvest(self, count: int, share: float, reason: str = "") -> int:
        """Run `count` training ranks beside Serve replicas, each holding `share` of a replica's device
        (new ones start while training runs, then join in one regroup); returns how many do."""
        check_harvest(count, share, num_whole=len(whole_members(self.members)), sizes=self.sizes,
                      planned=self.planner is not None)
        missing = count - len(harvest_members(self.members))
        incoming = self._start_harvest_workers(missing, share, HARVEST_START_TIMEOUT_S) if missing > 0 else []
        wanted = len(harvest_members(self.members)) + len(incoming) if missing > 0 else count
        self._resize_done.clear()
        self._harvest_request = HarvestRequest(wanted, incoming, reason)
        while not self.machine.done and not self._resize_done.wait(0.1):
            pass
        return len(harvest_members(self.members))

    def _start_harvest_workers(self, count: int, share: float, timeout_s: float) -> list[Worker]:
        """Start `count` harvest ranks and wait for them (training runs meanwhile); those that did not
        come up within `timeout_s` (no device has `share` free) are stopped."""
        started = self.pool.start(count, share=share)
        up = WorkerPool.ready(started, timeout_s)
        self.pool.stop([worker for worker in started if worker not in up])
        return up

    @ray.method(concurrency_group="control")
    def latest_model_state(self) -> tuple[int, ray.ObjectRef]:
        """(step, ref to the canonical model weights) from the newest in-memory snapshot."""
        for _ in range(10):  # stages can be a step apart for a moment while training runs
            step, state = StateSources.gather_state(list(enumerate(self.members)), self.layout)
            if state is not None:
                break
            time.sleep(0.05)
        if state is None:
            raise RuntimeError("no snapshot yet: training has not completed a step")
        return step, ray.put(state["model"])

    @ray.method(concurrency_group="control")
    def stop(self) -> None:
        self._stop_requested = True

    # ----- phases -----

    def _plan(self) -> tuple[Phase, str]:
        with warnings.catch_warnings():  # Ray warns about an internal property this one reads
            warnings.simplefilter("ignore", DeprecationWarning)
            restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self.step_log = StepLog(self.run_config.run_dir / "steps.jsonl", resume=restarted)
        if restarted:
            return self._resume_after_restart()
        if self.planner is not None:
            self.events.record("plan", "the planner lays out the devices the workers get", valid_sizes=list(self.sizes))
            return Phase.STARTING, "layout planned once the workers are up"
        self.events.record("plan", f"layout {self.layout.describe()}", valid_sizes=list(self.sizes))
        return Phase.STARTING, f"layout {self.layout.describe()}"

    def _start(self) -> tuple[Phase, str]:
        room = self.pool.free_devices() - self.target_workers
        started = self.pool.start(self.target_workers, self.speeds)
        if self.elastic.num_spares and room > 0:  # alongside the members: warm before the first failure
            self.spares.extend(self.pool.start(min(self.elastic.num_spares, room)))
        members = self.pool.ready(started, self.scaling.placement_timeout_s)
        if len(members) < self.target_workers:
            self.pool.stop(started + self.spares)
            return Phase.FAILED, f"only {len(members)} of {self.target_workers} workers started"
        self._start_spares(self.elastic.num_spares - len(self.spares))
        self._regroup(self.pool.by_locality(members), None)
        if self.planner is not None:  # grow back to what the planner chose on full capacity
            self.target_workers = len(self.members)
        self.events.record("start", f"{len(members)} workers", train_devices=len(members), infer_devices=0)
        return Phase.RUNNING, "workers up"

    def _run_step(self) -> tuple[Phase, str]:
        if self._inflight is None:
            if self._stop_requested:
                return Phase.FINISHED, "stopped by request"
            if self.step >= self.job.train.num_steps:
                return Phase.FINISHED, f"{self.step} steps done"
            if self._resize_request is not None or self._harvest_request is not None or self._growth_due():
                return Phase.RESIZING, "resize"
        refs = self._inflight or self._dispatch_step(self.step)
        # The next step waits in each worker's queue and starts the moment this one ends,
        # instead of a controller round trip later.
        self._inflight = self._dispatch_step(self.step + 1) if self._may_run_ahead() else None
        phase = self._complete_step(refs)
        if phase is not None:
            return phase
        evicted = self._check_stragglers()
        if evicted is not None:
            drained = self._drain_inflight()  # the step queued behind this one completes first
            self._recovery_started = time.monotonic()
            return drained or (Phase.RECOVERING, f"straggler rank {evicted}")
        return Phase.RUNNING, ""

    def _may_run_ahead(self) -> bool:
        return (
            self.step + 1 < self.job.train.num_steps
            and self._resize_request is None
            and self._harvest_request is None
            and not self._stop_requested
            and len(whole_members(self.members)) >= self.target_workers
        )

    def _complete_step(self, refs: list[ray.ObjectRef]) -> tuple[Phase, str] | None:
        """Watch step `self.step` to its end; record it, or hand the failure to recovery."""
        began = time.monotonic() if self._last_completion is None else max(self._last_completion, self._dispatched_at)
        outcome = watch_step(self.members, refs, self._watch_times())
        if not outcome.ok:
            self._inflight = None  # queued behind a failed step; workers refuse it at once
            self._pending_failure = outcome
            if self._failed_step is None:  # a second failure before the recovery ends keeps the first
                self._failed_step, self._failed_step_metrics = self.step, outcome.metrics
            self._recovery_started = self._recovery_started or began
            self._last_completion = None
            return Phase.RECOVERING, self._describe_failure(outcome)
        self._last_completion = time.monotonic()
        self._record_step(outcome.metrics, self._last_completion - began)
        self.state_sources.persist_if_due(self.step, self.members, self.layout)
        self.state_sources.replicate_if_due(self.step, self.members, self.layout, self.pool.ready(self.spares))
        self.step += 1
        return None

    def _drain_inflight(self) -> tuple[Phase, str] | None:
        if self._inflight is None:
            return None
        refs, self._inflight = self._inflight, None
        return self._complete_step(refs)

    # ----- a step -----

    def _dispatch_step(self, step: int) -> list[ray.ObjectRef]:
        self.state_sources.await_replicas(step, self.step - self._generation_steps,
                                          min(self._deadline(), self.elastic.heartbeat_timeout_s))
        due = self.faults.arm(step)
        timeout = self._deadline() if len(self.step_times) >= WARMUP_STEPS and self._generation_steps > 0 else None
        persist_to = self.state_sources.persist_target(step, self.layout)
        snapshot = step % self.elastic.snapshot_every == 0 or persist_to is not None
        self._dispatched_at = time.monotonic()
        return [
            worker.actor.elastic_step.remote(step, snapshot=snapshot, fault=due.get(rank), collective_timeout_s=timeout,
                                             persist_to=persist_to)
            for rank, worker in enumerate(self.members)
        ]

    def _deadline(self) -> float:
        recent = self.step_times[-20:]
        # A new generation's first step (new engine, new layout, newly started workers) is no
        # slower a hang than the job's first: earlier generations' step times do not bound it.
        warm = len(recent) >= WARMUP_STEPS and self._generation_steps > 0
        return self.elastic.step_deadline_s(statistics.median(recent) if warm else None)

    def _watch_times(self) -> WatchTimes:
        return WatchTimes(self._deadline(), self.elastic.heartbeat_interval_s, self.elastic.heartbeat_timeout_s)

    def _record_step(self, per_rank: list[dict], seconds: float) -> None:
        experts = self._record_expert_load(per_rank) if "expert_tokens" in per_rank[0] else {}
        self.step_log.append({**experts,
            "step": self.step,
            "loss": per_rank[0]["group_loss"],
            "learning_rate": per_rank[0]["learning_rate"],
            "step_time_s": seconds,
            "tokens": per_rank[0]["group_tokens"],
            "num_workers": len(per_rank),
            "snapshot_stall_s": max(m["snapshot_stall_s"] for m in per_rank),
            "peak_host_memory_bytes": max(m.get("peak_host_memory_bytes", 0) for m in per_rank),
        })
        self._export_metrics(per_rank, seconds)
        self.step_times.append(seconds)
        self._generation_steps += 1
        self.productive_s += seconds
        self.compute_history = (self.compute_history + [tuple(m["compute_s"] for m in per_rank)])[-50:]
        if self._recovery_started is not None:
            self._finish_recovery(time.monotonic() - self._recovery_started)

    def _record_expert_load(self, per_rank: list[dict]) -> dict:
        """Keep and export the step's expert load; returns the step log's fields for it."""
        stages = [self.layout.coords(rank).pp for rank in range(len(per_rank))]
        self.expert_load = expert_load([m["expert_tokens"] for m in per_rank], stages)
        self.job_metrics.expert_imbalance(imbalance(self.expert_load))
        return {"expert_imbalance": round(imbalance(self.expert_load), 4)}

    def _record_unreported(self, per_rank: list[dict | None], step: int) -> None:
        """A step that finished everywhere but whose result died with a lost worker: any survivor holds
        the whole group's loss and tokens (its step time is unknown)."""
        reported = [m for m in per_rank if m is not None and m.get("step") == step]
        if not reported:
            return
        self.step_log.append({
            "step": step,
            "loss": reported[0]["group_loss"],
            "learning_rate": reported[0]["learning_rate"],
            "step_time_s": float("nan"),
            "tokens": reported[0]["group_tokens"],
            "num_workers": len(reported),
            "snapshot_stall_s": max(m["snapshot_stall_s"] for m in reported),
            "partial": len(reported) < len(per_rank),
        })

    def _export_metrics(self, per_rank: list[dict], seconds: float) -> None:
        tokens_per_s = sum(m["tokens"] for m in per_rank) / seconds if seconds > 0 else 0.0
        peak = self.elastic.peak_flops_per_device
        mfu = estimate_mfu(tokens_per_s, self.num_parameters, len(per_rank), peak) if peak and tokens_per_s else 0.0
        self.job_metrics.step(step_time_s=seconds, tokens_per_s=tokens_per_s, mfu=mfu, num_workers=len(per_rank))
        self.job_metrics.devices(train=len(per_rank), infer=0)
        for rank, (worker, metrics) in enumerate(zip(self.members, per_rank)):
            node, device = worker.info.node_id[:12], worker.info.device_index
            self.job_metrics.worker_step(node=node, worker=rank, device=device, step_time_s=metrics["compute_s"])
            self.job_metrics.snapshot_stall(metrics["snapshot_stall_s"], node=node, worker=rank)

    def _check_stragglers(self) -> int | None:
        if not self.elastic.evict_stragglers or len(self.members) < 2:
            return None
        decision = decide_straggler(StragglerObservation(
            compute_s=tuple(self.compute_history),
            threshold=self.elastic.straggler_threshold,
            patience=self.elastic.straggler_patience,
            num_spares=len(self.pool.ready(self.spares)),
            min_workers=self.min_workers,
            replica_size=replica_size(self.layout),
            valid_sizes=self.sizes,
            step_s=statistics.median(self.step_times[-self.elastic.straggler_patience:]),
        ))
        if decision.action is StragglerAction.TOLERATE:
            return None
        self.events.record("straggler", decision.reason, rank=decision.rank, action=decision.action.value)
        self.compute_history = []
        self._pending_failure = None
        self._evicting = {decision.rank: decision.reason}
        return decision.rank

    def _growth_due(self) -> bool:
        now = time.monotonic()
        if len(whole_members(self.members)) >= self.target_workers or now - self._last_growth_check < self.elastic.grow_check_interval_s:
            return False
        self._last_growth_check = now
        if self._growth_target() > len(whole_members(self.members)):
            return True
        self._last_growth_check = now - self.elastic.grow_check_interval_s + 0.1  # spares starting: look again soon
        return False

    def _describe(self, rank: int, worker: Worker) -> dict:
        info = worker.info
        if info is None:  # lost, or not found after a controller restart
            return {"rank": rank, "node_id": None, "node_ip": None, "device_index": None, "pid": None,
                    "speed": worker.speed, "share": worker.share}
        return {"rank": rank, "node_id": info.node_id, "node_ip": info.node_ip,
                "device_index": info.device_index, "pid": info.pid, "speed": worker.speed, "share": worker.share}

    @staticmethod
    def _describe_failure(outcome) -> str:
        lost = ", ".join(f"rank {rank}: {why}" for rank, why in sorted(outcome.lost.items()))
        return lost or f"{len(outcome.failed)} rank(s) failed their step"

    def layout_for(self, num_workers: int) -> ParallelLayout:
        return layout_for(self.requested_layout, num_workers, self.job)
