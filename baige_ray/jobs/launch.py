"""`launch`: start an elastic training job in the background and get a handle to steer it.

The job is driven by an `ElasticController` actor, named after the run so that
`baige-ray status` and a restarted driver can find it. It restarts itself after a
crash and resumes from the surviving workers' snapshots.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

import ray

from baige_ray.actors.controller import CONTROLLER_THREADS, ElasticController
from baige_ray.api.configs import RunConfig, ScalingConfig, TrainConfig
from baige_ray.api.connection import connect_ray
from baige_ray.api.elastic import ElasticConfig
from baige_ray.api.result import Result, StepMetrics
from baige_ray.elastic.faults import FaultPlan
from baige_ray.elastic.planning import ElasticPlanner
from baige_ray.elastic.shelf import run_shelves
from baige_ray.elastic.sizing import layout_for
from baige_ray.elastic.workers import NAMESPACE, kill_named_actors
from baige_ray.engines.train_job import TrainJob
from baige_ray.jobs.fit import check_execution, check_speeds
from baige_ray.parallel.layout import ParallelLayout
from baige_ray.runtime.progress import JobProgress
from baige_ray.topology.descriptor import ClusterDescriptor
from baige_ray.topology.head import on_head_node
from baige_ray.topology.simulated import SimulatedCluster

# Without limit: the 30-minute soak's fourth controller SIGKILL found a bound of 3 and ended the job. A
# controller that keeps dying fails the job itself (elastic/startup.py: CRASH_LOOP_RESTARTS).
CONTROLLER_RESTARTS = -1
logger = logging.getLogger(__name__)


class TrainingJob:
    """A running elastic job. Every method is a call to its controller actor."""

    def __init__(self, controller: ray.actor.ActorHandle, name: str, model: Any = None, *,
                 num_steps: int | None = None, adapter: Any = None):
        """With `num_steps`, a progress line follows the job until `wait()` (RunConfig.show_progress)."""
        self.controller = controller
        self.name = name
        self.model = model  # the model config it trains (serve(job) serves it)
        self.adapter = adapter  # the peft.LoraConfig it trains, if any (serve(adapters={name: job}) serves it)
        self._run_ref = controller.run.remote()
        self._progress = JobProgress(self.status, num_steps).start() if num_steps is not None else None

    def status(self) -> dict:
        return ray.get(self.controller.status.remote())

    def wait_for_step(self, steps: int, timeout_s: float = 60.0) -> dict:
        """The job's status once `steps` steps are done, the job ended, or `timeout_s` passed, whichever
        comes first (its "step" and "state" say which)."""
        return ray.get(self.controller.wait_for_step.remote(steps, timeout_s))

    def wait_for_snapshot(self, steps: int, timeout_s: float = 60.0) -> tuple[int, ray.ObjectRef]:
        """`latest_model_state()` once `steps` steps are done and the newest snapshot has stopped changing: for a
        job held by `steps_allowed`, the snapshot of the last step it may run (copied after that step ends)."""
        deadline = time.monotonic() + timeout_s
        self.wait_for_step(steps, timeout_s)
        newest = self.latest_model_state()
        while time.monotonic() < deadline:
            time.sleep(0.2)
            again = self.latest_model_state()
            if again[0] == newest[0]:
                return again
            newest = again
        return newest

    def resize(self, num_workers: int, *, reason: str = "") -> int:
        """Train on `num_workers` whole devices; returns once it does."""
        return ray.get(self.controller.resize.remote(num_workers, reason))

    def allow_steps(self, until: int) -> int | None:
        """Let the steps below `until` run (a job launched with `steps_allowed`); returns the bound in
        force once the controller took it, None if the job ended first."""
        return ray.get(self.controller.allow_steps.remote(until))

    def harvest(self, count: int, *, share: float, reason: str = "") -> int:
        """Run `count` extra ranks beside Serve replicas, each on `share` of a replica's device (the
        replicas ask for 1 - share); returns how many do."""
        return ray.get(self.controller.harvest.remote(count, share, reason))

    def latest_model_state(self) -> tuple[int, ray.ObjectRef]:
        return ray.get(self.controller.latest_model_state.remote())

    def stop(self) -> None:
        """Finish after the current step; `wait()` then returns the result so far."""
        ray.get(self.controller.stop.remote())

    def kill(self) -> None:
        """Tear the job down now: its controller and every worker actor of this run."""
        self._close_progress()
        ray.kill(self.controller, no_restart=True)
        kill_run_actors(self.name)

    def wait(self, timeout_s: float | None = None) -> Result:
        outcome = ray.get(self._run_ref, timeout=timeout_s)
        self._close_progress(outcome["status"])
        final_state = outcome.get("final_state")
        if final_state is not None:  # the controller owns it; take a copy before it goes
            final_state = ray.put(ray.get(final_state))
        ray.kill(self.controller, no_restart=True)
        return Result(
            metrics=[
                StepMetrics(step=m["step"], loss=m["loss"], learning_rate=m["learning_rate"],
                            step_time_s=m["step_time_s"], tokens=m["tokens"],
                            peak_host_memory_gb=m.get("peak_host_memory_bytes", 0) / 1e9,
                            peak_device_memory_gb=m.get("peak_device_memory_bytes", 0) / 1e9,
                            snapshot_stall_s=m.get("snapshot_stall_s", 0.0),
                            finished_at=m.get("finished_at"), policy_samples=m.get("policy_samples"))
                for m in outcome["metrics"]
            ],
            checkpoint_path=Path(outcome["checkpoint_path"]) if outcome["checkpoint_path"] else None,
            workers=outcome["workers"],
            layout=outcome["layout"],
            elapsed_s=outcome["elapsed_s"],
            recoveries=outcome["recoveries"],
            final_state=final_state,
        )

    def _close_progress(self, final: dict | None = None) -> None:
        if self._progress is not None:
            self._progress.close(final)
            self._progress = None


def kill_run_actors(run_name: str) -> int:
    """Kill the detached actors a run left behind (a crashed driver, a failed test); returns how many."""
    killed = kill_named_actors((f"baige-worker:{run_name}:", f"baige-controller:{run_name}"))
    # Their snapshot shelves on this node go too (other nodes' go with a run that ends normally).
    shutil.rmtree(run_shelves(run_name), ignore_errors=True)
    return killed


def launch(
    model: Any,
    *,
    train: TrainConfig,
    scaling: ScalingConfig | None = None,
    run: RunConfig | None = None,
    elastic: ElasticConfig | None = None,
    data: Any = None,
    layout: ParallelLayout | str | None = None,
    emulated_speeds: list[float] | None = None,
    faults: FaultPlan | None = None,
    worker_cls: type | None = None,
    cluster: ClusterDescriptor | None = None,
    objective: Any = None,
    steps_allowed: int | None = None,
    adapter: Any = None,
) -> TrainingJob:
    """Start training `model` (a registered model config, as for `fit`) in the background;
    `job.wait()` returns the `Result`.

    `layout` is an explicit `ParallelLayout`, "ddp" (the default: data parallel over every
    worker) or "auto": the planner lays out the devices the workers get, and re-plans them
    after every failure and resize (`cluster` is the descriptor when not simulated).
    `objective` replaces the model's loss (TrainJob.objective); with `steps_allowed` only the steps
    below it run until `job.allow_steps(n)` raises the bound (a trainer that feeds each step's data).
    `adapter` (a `peft.LoraConfig`) trains a LoRA adapter on the frozen model, as for `fit`.
    """
    if steps_allowed is not None and (not isinstance(steps_allowed, int) or steps_allowed < 0):
        raise ValueError(f"launch steps_allowed={steps_allowed!r} is invalid: expected None or a step count >= 0")
    job = TrainJob(model=model, train=train, data=data, objective=objective, adapter=adapter)
    if adapter is not None and layout == "auto":  # the planner's re-plans are never checked against adapters
        raise ValueError("launch layout='auto' is invalid with adapter=: the planner may choose tensor or expert "
                         "parallelism, which adapters do not train in yet; pass 'ddp' or a ParallelLayout")
    scaling = scaling or ScalingConfig()
    run = run or RunConfig()
    elastic = elastic or ElasticConfig()
    planner, layout = _planner_and_layout(job, scaling, layout, cluster)
    if not ray.is_initialized():
        connect_ray(logging_level=logging.WARNING)
    speeds = check_execution(job, scaling, layout, emulated_speeds, cluster=cluster, elastic=elastic) \
        if planner is None else check_speeds(scaling, emulated_speeds)
    if kill_run_actors(run.name):
        logger.warning("killed actors left behind by an earlier run named %r", run.name)
    controller = _start_controller(job, scaling, run, elastic, layout, speeds=list(speeds), faults=faults,
                                   planner=planner, worker_cls=worker_cls, steps_allowed=steps_allowed)
    return TrainingJob(controller, run.name, job.model, num_steps=train.num_steps if run.show_progress else None,
                       adapter=adapter)


def _planner_and_layout(job: TrainJob, scaling: ScalingConfig, layout: ParallelLayout | str | None,
                        cluster: ClusterDescriptor | None) -> tuple[ElasticPlanner | None, ParallelLayout]:
    """The planner that lays out the devices (layout "auto"), or None, and the layout to start with."""
    planner = None
    if layout == "auto":
        if cluster is None and SimulatedCluster.active() is not None:
            cluster = SimulatedCluster.active().descriptor
        planner = ElasticPlanner(job, cluster)
        layout = None
    elif isinstance(layout, str) and layout != "ddp":
        raise ValueError(f"launch layout={layout!r} is invalid: expected 'ddp', 'auto' or a ParallelLayout")
    if not isinstance(layout, ParallelLayout):  # any size the job may later resize to, uneven shares included
        layout = layout_for(ParallelLayout(dp=scaling.num_workers), scaling.num_workers, job)
    return planner, layout


def _start_controller(job: TrainJob, scaling: ScalingConfig, run: RunConfig, elastic: ElasticConfig,
                      layout: ParallelLayout, *, worker_cls: type | None, **options):
    if worker_cls is not None:
        options["worker_cls"] = worker_cls
    return ray.remote(**CONTROLLER_THREADS)(ElasticController).options(
        name=f"baige-controller:{run.name}",
        namespace=NAMESPACE,
        lifetime="detached",
        num_cpus=0,
        scheduling_strategy=on_head_node(),  # a worker node's loss must not take the controller too
        max_restarts=CONTROLLER_RESTARTS,
        max_task_retries=CONTROLLER_RESTARTS,
    ).remote(job, scaling, run, elastic, layout, **options)
