"""The elastic controller: one actor per training job that owns its workers, spares and plan.

A thin loop over an explicit state machine (baige_ray/elastic/machine.py): each phase has one
handler, which returns the next phase. The work is done by collaborators, each owning its state:
the crew (who trains), the step runner, recovery, the resizer (the control thread's commands and
growth), the step accounts and the run's end. Policies (policies/) decide; this class wires them
to Ray and answers the control thread, which reaches the loop only through the command queue.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import ray

from baige_ray.actors.worker import ELASTIC_WORKER_THREADS, ElasticWorkerActor
from baige_ray.api.configs import RunConfig, ScalingConfig
from baige_ray.api.elastic import ElasticConfig
from baige_ray.elastic.accounts import StepAccounts
from baige_ray.elastic.commands import AllowSteps, Command, Harvest, JobOver, Resize, Stop
from baige_ray.elastic.crew import Crew
from baige_ray.elastic.device_holds import ReleasedDevices
from baige_ray.elastic.ending import RunEnd
from baige_ray.elastic.faults import FaultKind, FaultPlan
from baige_ray.elastic.harvest import check_harvest, harvest_members, whole_members
from baige_ray.elastic.job_record import JobRecord
from baige_ray.elastic.liveness import LivenessListener
from baige_ray.elastic.machine import Phase, StateMachine
from baige_ray.elastic.planning import ElasticPlanner
from baige_ray.elastic.recovery import Bounds, Recovery
from baige_ray.elastic.resizing import Resizer
from baige_ray.elastic.sizing import valid_sizes
from baige_ray.elastic.startup import Startup
from baige_ray.elastic.state_sources import StateSources
from baige_ray.elastic.stepping import StepRunner
from baige_ray.elastic.workers import Worker, WorkerPool, restarted_by_ray
from baige_ray.engines.train_job import TrainJob
from baige_ray.ops.events import EventLog
from baige_ray.parallel.layout import ParallelLayout
from baige_ray.parallel.packed_tensors import pack_tensors
from baige_ray.runtime.resources import choose_device_resource

CONTROLLER_THREADS = {"max_concurrency": 1, "concurrency_groups": {"loop": 1, "control": 4}}
HARVEST_START_TIMEOUT_S = 60.0  # a harvest rank not up by then found no device share free
GATE_WAIT_S = 0.5  # a loop held by steps_allowed looks at growth this often when no command comes
logger = logging.getLogger(__name__)


def ray_worker_pool(scaling: ScalingConfig, run_name: str, worker_cls: type, snapshot_slots: int,
                    preload: tuple) -> WorkerPool:
    """Worker actors of `worker_cls` with their concurrency groups, each holding a device of this cluster and
    a connection to this controller's liveness listener (on this node's address, which every node reaches)."""
    resource = choose_device_resource(scaling, ray.cluster_resources())
    return WorkerPool(scaling, run_name, resource, ray.remote(**ELASTIC_WORKER_THREADS)(worker_cls), snapshot_slots,
                      preload=preload, liveness=LivenessListener(ray.util.get_node_ip_address()))


class ElasticController:
    def __init__(self, job: TrainJob, scaling: ScalingConfig, run: RunConfig, elastic: ElasticConfig,
                 layout: ParallelLayout, *, speeds: list[float] | None = None, faults: FaultPlan | None = None,
                 worker_cls: type = ElasticWorkerActor, planner: ElasticPlanner | None = None,
                 pool: WorkerPool | None = None, record: JobRecord | None = None,
                 was_restarted: Callable[[], bool] | None = None, steps_allowed: int | None = None):
        """`pool`, `record` and `was_restarted` default to Ray's (unit tests pass their own).
        `steps_allowed`: only steps below it run until `allow_steps` raises it (None: all of them)."""
        self.job, self.scaling, self.run_config, self.elastic = job, scaling, run, elastic
        self.faults, self.speeds = faults or FaultPlan(), list(speeds or [1.0] * scaling.num_workers)
        self.machine = StateMachine()
        self.events = EventLog(run.run_dir / "events.jsonl")
        self.pool = pool or ray_worker_pool(scaling, run.name, worker_cls, elastic.snapshot_slots, (job, layout))
        min_workers, max_workers = elastic.bounds(scaling.num_workers)
        # The planner may use any number of the devices it is given (idle ones stay as spares).
        self.sizes = (tuple(range(min_workers, max_workers + 1)) if planner is not None
                      else valid_sizes(job, layout, min_workers, max_workers))
        bounds = Bounds(min_workers, self.sizes, elastic.max_recoveries, scaling.placement_timeout_s)
        self.accounts = StepAccounts(run.name, elastic)
        self.state_sources = StateSources(elastic, run.name, self.events)
        record = record or JobRecord(run.name)
        self.crew = Crew(job, layout, self.pool, planner=planner, accounts=self.accounts, events=self.events,
                         faults=self.faults, record=record, placement_timeout_s=scaling.placement_timeout_s,
                         released=ReleasedDevices(elastic.released_device_hold_s))
        self.recovery = Recovery(self.crew, self.pool, self.state_sources, self.accounts, self.events, bounds)
        self.resizer = Resizer(self.crew, self.pool, self.state_sources, self.accounts, self.events, self.recovery,
                               elastic, sizes=self.sizes, target_workers=scaling.num_workers,
                               steps_allowed=steps_allowed)
        self.steps = StepRunner(self.crew, self.state_sources, self.accounts, self.recovery, self.events, self.faults,
                                elastic, bounds)
        self.ending = RunEnd(self.crew, self.pool, job, run.name, run.run_dir, record)
        self.startup = Startup(self.crew, self.pool, self.accounts, self.recovery, self.resizer, self.events, run=run,
                               scaling=scaling, elastic=elastic, speeds=self.speeds, sizes=self.sizes,
                               was_restarted=was_restarted or restarted_by_ray)

    @property
    def step(self) -> int:
        return self.accounts.next_step

    # ----- the loop -----

    @ray.method(concurrency_group="loop")
    def run(self) -> dict:
        handlers = {
            Phase.PLANNING: self.startup.plan,
            Phase.STARTING: self.startup.start,
            Phase.RUNNING: self._run_step,
            Phase.RECOVERING: self.recovery.recover,
            Phase.RESIZING: self.resizer.resize,
        }
        try:
            while not self.machine.done:
                phase, reason = self._handle(handlers[self.machine.phase])
                self.machine.advance(phase, reason)
                if phase in (Phase.FINISHED, Phase.FAILED):
                    self.events.record(phase.value, reason, step=self.step)
            return self._finish()
        finally:
            self._release()

    def _handle(self, handler: Callable[[], tuple[Phase, str]]) -> tuple[Phase, str]:
        """The phase `handler` leads to; FAILED, with the error as the reason, where it raises. A loop that
        died of an error left a job that still read "recovering" with nothing in its events (a 30-minute
        soak stalled so for minutes)."""
        try:
            return handler()
        except Exception as error:
            logger.exception("the controller failed in phase %s", self.machine.phase.value)
            return Phase.FAILED, f"the controller failed while {self.machine.phase.value}: {error!r}"

    def _run_step(self) -> tuple[Phase, str]:
        self.resizer.keep_spares()
        if self.steps.between_steps:
            self.resizer.take_commands()
            if self.resizer.stopping:
                return Phase.FINISHED, "stopped by request"
            if self.step >= self.job.train.num_steps:
                return Phase.FINISHED, f"{self.step} steps done"
            if self.resizer.due():
                return Phase.RESIZING, "resize"
            if not self.resizer.allows(self.step):  # waiting for allow_steps, or any other command
                self.resizer.commands.wait(GATE_WAIT_S)
                return Phase.RUNNING, ""
        run_ahead = (self.step + 1 < self.job.train.num_steps and self.resizer.quiet()
                     and self.resizer.allows(self.step + 1))
        return self.steps.run(self.step, run_ahead) or (Phase.RUNNING, "")

    def _finish(self) -> dict:
        result = {"phase": self.machine.phase.value, "metrics": self.accounts.all_records(),
                  "recoveries": self.recovery.history, "layout": self.crew.layout.describe(),
                  "workers": [w.info for w in self.crew.members], "elapsed_s": time.time() - self.accounts.started_at,
                  "checkpoint_path": None, "status": self.status()}
        if self.machine.phase is Phase.FINISHED and self.crew.members:
            result.update(self.ending.final_weights(self.step, self._close_commands()))
        self.state_sources.close()
        self.accounts.close()
        return result

    def _release(self) -> None:
        self.ending.release(self._close_commands())

    def _close_commands(self) -> list[Worker]:
        return self.resizer.close(f"the job is {self.machine.phase.value}")

    # ----- the control thread -----

    @ray.method(concurrency_group="control")
    def status(self) -> dict:
        return {
            "name": self.run_config.name,
            "state": self.machine.phase.value,
            "step": self.step,
            "num_steps": self.job.train.num_steps,
            "steps_allowed": self.resizer.steps_allowed,
            "sizes": list(self.sizes),  # the worker counts a resize may ask for
            **self.crew.report(),
            "events": self.events.recent(20),
            **self.accounts.report(len(self.crew.members)),
            "recoveries": list(self.recovery.history),
            "faults_fired": {kind.value: self.faults.count(kind) for kind in FaultKind},
            **self.state_sources.report(),
        }

    @ray.method(concurrency_group="control")
    def wait_for_step(self, steps: int, timeout_s: float) -> dict:
        """The status once `steps` steps are done, the job ended, or `timeout_s` passed (a long poll)."""
        self.accounts.progress.wait_for(steps, timeout_s, ended=lambda: self.machine.done)
        return self.status()

    @ray.method(concurrency_group="control")
    def resize(self, num_workers: int, reason: str = "") -> int:
        """Ask training to run on `num_workers` whole devices (plus any harvest ranks, a valid size in
        all); returns once it does."""
        harvesting = len(harvest_members(self.crew.members))
        if num_workers + harvesting not in self.sizes:
            raise ValueError(f"num_workers={num_workers} is invalid: with {harvesting} harvest rank(s), expected "
                             f"one of {[size - harvesting for size in self.sizes if size > harvesting]}")
        return self._ask(Resize(num_workers, reason))

    @ray.method(concurrency_group="control")
    def harvest(self, count: int, share: float, reason: str = "") -> int:
        """Run `count` training ranks beside Serve replicas, each holding `share` of a replica's device
        (new ones start while training runs, then join in one regroup); returns how many do."""
        members = self.crew.members
        check_harvest(count, share, num_whole=len(whole_members(members)), sizes=self.sizes,
                      planned=self.crew.planner is not None)
        missing = count - len(harvest_members(members))
        # New ones start while training runs; one not up in time found no device share free.
        incoming = self.pool.start_and_wait(missing, share, HARVEST_START_TIMEOUT_S) if missing > 0 else []
        wanted = len(harvest_members(members)) + len(incoming) if missing > 0 else count
        return self._ask(Harvest(wanted, tuple(incoming), reason))

    @ray.method(concurrency_group="control")
    def allow_steps(self, until: int) -> int | None:
        """Let the steps below `until` run (a job started with `steps_allowed`); returns the bound in
        force once the loop took it, None if the job ended first."""
        if not isinstance(until, int) or until < 0:
            raise ValueError(f"until={until!r} is invalid: expected a step count >= 0")
        return self._ask(AllowSteps(until))

    @ray.method(concurrency_group="control")
    def stop(self) -> None:
        self.resizer.commands.submit(Stop())

    def _ask(self, command: Command):
        try:
            return self.resizer.commands.submit(command).result()
        except JobOver:  # the loop ended first: nothing changes any more
            if isinstance(command, Harvest):
                self.pool.stop(list(command.incoming))
            return self.resizer.answer_for(command)

    @ray.method(concurrency_group="control")
    def latest_model_state(self) -> tuple[int, ray.ObjectRef]:
        """(step, ref to the canonical model weights) from the newest in-memory snapshot: a `PackedTensors`
        (a mapping of names to tensors whose bytes Ray moves without pickling them)."""
        step, weights = StateSources.newest_weights(list(enumerate(self.crew.members)), self.crew.layout)
        return step, self.pool.put(pack_tensors(weights))

