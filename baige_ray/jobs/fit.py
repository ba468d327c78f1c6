"""`fit`: train a model on worker actors spread over the Ray cluster.

The driver only orchestrates: it starts one worker actor per device, forms the
process group, has every worker build the engine its layout needs (DDP, FSDP2,
DeepSpeed ZeRO, DTensor TP, pipelining), has every worker run the steps (several
per call, the next call queued behind the running one), reduces their metrics,
and writes the final weights it gathers in canonical form.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray

from baige_ray.api.configs import RunConfig, ScalingConfig, TrainConfig
from baige_ray.api.connection import connect_ray
from baige_ray.api.errors import ClusterError
from baige_ray.api.result import Result, StepMetrics
from baige_ray.engines.exact_gradients import check_world_size_invariant
from baige_ray.engines.host_allocator import return_freed_memory
from baige_ray.engines.train_job import TrainJob
from baige_ray.jobs.worker_group import WorkerGroup
from baige_ray.models.adapters import check_adapter_layout
from baige_ray.parallel.layout import ParallelLayout
from baige_ray.parallel.state import CanonicalState, merge_weights
from baige_ray.runtime.memory_check import check_layout_memory
from baige_ray.runtime.progress import StageProgress, TrainingProgress
from baige_ray.topology.descriptor import ClusterDescriptor

if TYPE_CHECKING:
    from baige_ray.api.elastic import ElasticConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExecutionPlan:
    """What the workers run and where: the layout, per-rank chip speeds, and optional planned placement."""

    layout: ParallelLayout
    emulated_speeds: tuple[float, ...]
    placement: object | None = None  # a planner MaterializedPlan; None packs ranks by locality
    explanation: str = ""


def _save_final(job: TrainJob, weights: dict, run: RunConfig):
    """The final checkpoint, with a progress line when writing it takes more than a second."""
    total = sum(tensor.numel() * tensor.element_size() for tensor in weights.values())
    with StageProgress("final checkpoint", enabled=run.show_progress, unit="B", unit_scale=True) as progress:
        progress(f"writing {run.run_dir / 'final'}", 0, total)
        checkpoint = job.save_final(run.run_dir / "final", weights, step=job.train.num_steps)
        progress(f"writing {run.run_dir / 'final'}", total, total)
    return checkpoint


def reduce_step_metrics(per_rank: list[dict]) -> StepMetrics:
    """Mean loss over the ranks that see it (last pipeline stage; replicas hold equal batches).

    The step time is the mean of the ranks' own: synchronous ranks take equally long on average, and
    the mean of their durations sums to the run's wall time, where the max would count each rank's
    scheduling jitter as the step's.
    """
    losses = [m["loss"] for m in per_rank if m["loss"] is not None]
    return StepMetrics(
        step=int(per_rank[0]["step"]),
        loss=sum(losses) / len(losses),
        learning_rate=per_rank[0]["learning_rate"],
        step_time_s=sum(m["rank_step_s"] for m in per_rank) / len(per_rank),
        tokens=int(sum(m["tokens"] for m in per_rank)),
        peak_host_memory_gb=max(m.get("peak_host_memory_bytes", 0) for m in per_rank) / 1e9,
        peak_device_memory_gb=max(m.get("peak_device_memory_bytes", 0) for m in per_rank) / 1e9,
    )


class StepCalls:
    """How many steps each `train_steps` call runs: one first, then about `target_s` of steps (at
    most `most`), so a round trip per call costs little beside the steps and the driver still hears
    of progress every `target_s`."""

    def __init__(self, start: int, end: int, *, target_s: float = 1.0, most: int = 16):
        if target_s <= 0 or most < 1:
            raise ValueError(f"StepCalls(target_s={target_s}, most={most}): expected target_s > 0, most >= 1")
        self.next_step, self.end, self.target_s, self.most = start, end, target_s, most
        self.step_time_s: float | None = None

    @property
    def remaining(self) -> int:
        return self.end - self.next_step

    def observe(self, step_time_s: float) -> None:
        self.step_time_s = step_time_s

    def next(self) -> tuple[int, int]:
        """(first step, count) of the next call; (end, 0) once every step has been handed out."""
        if self.step_time_s is None or self.step_time_s <= 0:
            count = 1
        else:
            count = max(1, min(self.most, int(self.target_s / self.step_time_s)))
        count = min(count, self.remaining)
        start, self.next_step = self.next_step, self.next_step + count
        return start, count


def fit(
    model: Any,
    *,
    train: TrainConfig,
    scaling: ScalingConfig | None = None,
    run: RunConfig | None = None,
    data: Any = None,
    layout: ParallelLayout | str = "ddp",
    emulated_speeds: list[float] | None = None,
    cluster: ClusterDescriptor | None = None,
    adapter: Any = None,
) -> Result:
    """Train `model` and return its metrics and final checkpoint.

    `model` is a registered model config: `HFModel` (a Hugging Face causal LM), `GPTConfig`, ...;
    `data` what it trains on: a `TokenDataset` for an HFModel, a `CorpusConfig` (default) for the GPT.

    `layout` is "ddp" (data parallel over every worker), "auto" (the planner picks
    degrees, engines and placement on the cluster's resource graph, `cluster`
    being its descriptor when not simulated by `open_cluster`), or an explicit
    `ParallelLayout`. `emulated_speeds` (one per rank) makes workers emulate slower
    chips. `adapter` (a `peft.LoraConfig`) trains a LoRA adapter on the frozen model; the final checkpoint is
    then a PEFT adapter directory. Connects to RAY_ADDRESS, or starts a local Ray, when no session is open.
    """
    job = TrainJob(model=model, train=train, data=data, adapter=adapter)
    scaling = scaling or ScalingConfig()
    run = run or RunConfig()
    if not ray.is_initialized():
        connect_ray(logging_level=logging.WARNING)
    execution = _execution_plan(job, scaling, layout, emulated_speeds, cluster)
    if execution.explanation:
        logger.info("planner: %s", execution.explanation)
    started = time.perf_counter()
    scaling = dataclasses.replace(scaling, num_workers=execution.layout.world_size)  # "auto" may use fewer
    group = WorkerGroup(scaling, timeout_s=run.step_timeout_s, placement=execution.placement)
    try:
        metrics = train_on_group(group, job, execution, run)
        weights = merge_weights(group.call("export_weights"))
    finally:
        group.shutdown()
    checkpoint = _save_final(job, weights, run)
    del weights
    return_freed_memory()  # the gathered weights (2 GB at 494M parameters) would stay in this process's heap
    return Result(
        metrics=metrics,
        checkpoint_path=checkpoint,
        workers=group.device_infos,
        layout=execution.layout.describe(),
        elapsed_s=time.perf_counter() - started,
    )


def _execution_plan(
    job: TrainJob,
    scaling: ScalingConfig,
    layout: ParallelLayout | str,
    speeds: list[float] | None,
    cluster: ClusterDescriptor | None,
) -> ExecutionPlan:
    placement, explanation = None, ""
    planned = layout == "auto"  # the planner returns only layouts that fit its memory model
    if planned:
        from baige_ray.planner.materialize import materialize
        from baige_ray.planner.report import explain_text
        from baige_ray.runtime.auto_plan import first_devices, layout_from_plan, live_graph, plan_job

        chosen = plan_job(job, first_devices(live_graph(cluster), scaling.num_workers))
        layout, explanation = layout_from_plan(chosen), explain_text(chosen)
        scaling = dataclasses.replace(scaling, num_workers=layout.world_size)
        placement = materialize(chosen, cpus_per_device=scaling.cpus_per_worker)
    elif layout == "ddp":
        layout = ParallelLayout(dp=scaling.num_workers)
    elif not isinstance(layout, ParallelLayout):
        raise ValueError(f"fit layout={layout!r} is invalid: expected 'ddp', 'auto' or a ParallelLayout")
    return ExecutionPlan(
        layout=layout,
        emulated_speeds=check_execution(job, scaling, layout, speeds, cluster=cluster, check_memory=not planned),
        placement=placement,
        explanation=explanation,
    )


def check_execution(
    job: TrainJob,
    scaling: ScalingConfig,
    layout: ParallelLayout,
    speeds: list[float] | None,
    *,
    cluster: ClusterDescriptor | None = None,
    elastic: ElasticConfig | None = None,
    check_memory: bool = True,
) -> tuple[float, ...]:
    """Fail on a layout that cannot run before any actor starts; returns per-rank speeds.

    With `check_memory` (Ray initialized), a layout whose device or host memory does not fit the live
    cluster raises LayoutMemoryError; `elastic`'s snapshots and replicas count against host memory.
    """
    if layout.world_size != scaling.num_workers:
        raise ValueError(
            f"ScalingConfig.num_workers={scaling.num_workers} is invalid: layout {layout.describe()} "
            f"expected {layout.world_size} workers"
        )
    layout.replica_batches(job.train)
    check_world_size_invariant(job.train, layout, job.plugin.engine)
    job.plugin.check_layout(layout)
    if job.adapter is not None:
        check_adapter_layout(layout)
    job.open_data()  # a missing or corrupt dataset fails before any actor starts
    if check_memory:
        check_layout_memory(job, scaling, layout, cluster=cluster, elastic=elastic)
    return check_speeds(scaling, speeds)


def check_speeds(scaling: ScalingConfig, speeds: list[float] | None) -> tuple[float, ...]:
    speeds = list(speeds or [1.0] * scaling.num_workers)
    if len(speeds) != scaling.num_workers or min(speeds) <= 0:
        raise ValueError(f"emulated_speeds={speeds!r} is invalid: expected {scaling.num_workers} positive numbers")
    return tuple(speeds)


def train_on_group(
    group: WorkerGroup,
    job: TrainJob,
    execution: ExecutionPlan,
    run: RunConfig,
    *,
    start_step: int = 0,
    end_step: int | None = None,
    initial_state: CanonicalState | None = None,
) -> list[StepMetrics]:
    """Form a new process-group generation on `group`, build the engines, train steps [start, end).

    With `initial_state` (canonical, from any layout) each rank cuts its shard from
    it first, so training resumes at `start_step` exactly where that state left off.
    """
    end_step = job.train.num_steps if end_step is None else end_step
    group.form_process_group()
    reports = group.call_each("build_engine", [(job, execution.layout, s) for s in execution.emulated_speeds])
    fingerprints = {report["data"] for report in reports}
    if len(fingerprints) != 1:
        # Nodes with different Python versions read different stdlib sources; a dataset changed under a run.
        raise ClusterError(f"workers read different training data {sorted(fingerprints)}; use one Python "
                           "version and one dataset on shared storage")
    if initial_state is not None:
        group.call("import_state", ray.put(initial_state))  # one copy in the object store for every rank
    metrics: list[StepMetrics] = []
    # Workers run several steps per call (one round trip, not one per step), and the next call is queued
    # on every worker before this one's metrics are awaited, so a worker starts it the moment it
    # finishes (actors run one call at a time): the driver's round trip leaves the step time.
    calls = StepCalls(start_step, end_step)

    def submit() -> tuple[list, int]:
        first, count = calls.next()
        return group.submit("train_steps", first, count), count

    in_flight, count = submit() if calls.remaining else ([], 0)
    with TrainingProgress(end_step - start_step, enabled=run.show_progress) as progress:
        while in_flight:
            queued, queued_count = submit() if calls.remaining else ([], 0)
            # RunConfig.step_timeout_s bounds each of the call's steps.
            per_rank = group.collect(in_flight, "train_steps", timeout_s=run.step_timeout_s * count)
            for step_of_each_rank in zip(*per_rank, strict=True):
                step_metrics = reduce_step_metrics(list(step_of_each_rank))
                calls.observe(step_metrics.step_time_s)
                if step_metrics.step % job.train.log_every == 0 or step_metrics.step == job.train.num_steps - 1:
                    metrics.append(step_metrics)
                progress.update(step_metrics)
            in_flight, count = queued, queued_count
    return metrics
