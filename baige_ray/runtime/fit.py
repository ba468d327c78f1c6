"""`fit`: train a model on worker actors spread over the Ray cluster.

The driver only orchestrates: it starts one worker actor per device, forms the
process group, has every worker build the engine its layout needs (DDP, FSDP2,
DeepSpeed ZeRO, DTensor TP, pipelining), triggers each step on every worker,
reduces their metrics, and writes the final weights it gathers in canonical form.
"""

from __future__ import annotations

import logging
import time

import ray

from baige_ray.api.configs import RunConfig, ScalingConfig, TrainConfig
from baige_ray.api.errors import ClusterError
from baige_ray.api.result import Result, StepMetrics
from baige_ray.engines.layout import ParallelLayout
from baige_ray.engines.state import merge_states
from baige_ray.models.corpus import CorpusConfig
from baige_ray.models.gpt import GPTConfig
from baige_ray.runtime.checkpoint_io import save_model_checkpoint
from baige_ray.runtime.progress import TrainingProgress
from baige_ray.runtime.train_loop import TrainJob
from baige_ray.runtime.worker_group import WorkerGroup

logger = logging.getLogger(__name__)


def reduce_step_metrics(per_rank: list[dict], step_time_s: float) -> StepMetrics:
    """Mean over the ranks that see the loss (last pipeline stage); replicas hold equal batches."""
    losses = [m["loss"] for m in per_rank if m["loss"] is not None]
    return StepMetrics(
        step=int(per_rank[0]["step"]),
        loss=sum(losses) / len(losses),
        learning_rate=per_rank[0]["learning_rate"],
        step_time_s=step_time_s,
        tokens=int(sum(m["tokens"] for m in per_rank)),
    )


def fit(
    model: GPTConfig | None = None,
    *,
    train: TrainConfig,
    scaling: ScalingConfig | None = None,
    run: RunConfig | None = None,
    corpus: CorpusConfig | None = None,
    layout: ParallelLayout | None = None,
    emulated_speeds: list[float] | None = None,
) -> Result:
    """Train `model` (the reference GPT by default) and return its metrics and final checkpoint.

    `layout` gives explicit DP/TP/PP degrees and engines; the default is DDP over
    every worker. `emulated_speeds` (one per rank) makes workers emulate slower
    chips. Connects to RAY_ADDRESS, or starts a local Ray, when no session is open.
    """
    job = TrainJob(model=model or GPTConfig(), train=train, corpus=corpus or CorpusConfig())
    scaling = scaling or ScalingConfig()
    run = run or RunConfig()
    layout = layout or ParallelLayout(dp=scaling.num_workers)
    speeds = _check_plan(job, scaling, layout, emulated_speeds)
    if not ray.is_initialized():
        ray.init(logging_level=logging.WARNING)
    started = time.perf_counter()
    group = WorkerGroup(scaling, timeout_s=run.step_timeout_s)
    try:
        group.form_process_group()
        _build_engines(group, job, layout, speeds)
        metrics = _train(group, job, run)
        state = merge_states(group.call("export_state"))
        checkpoint = save_model_checkpoint(
            run.run_dir / "final", state["model"], model_config=job.model, step=train.num_steps
        )
    finally:
        group.shutdown()
    return Result(
        metrics=metrics,
        checkpoint_path=checkpoint,
        workers=group.device_infos,
        elapsed_s=time.perf_counter() - started,
    )


def _check_plan(
    job: TrainJob, scaling: ScalingConfig, layout: ParallelLayout, speeds: list[float] | None
) -> list[float]:
    """Fail on a layout that cannot run before any actor starts."""
    if layout.world_size != scaling.num_workers:
        raise ValueError(
            f"ScalingConfig.num_workers={scaling.num_workers} is invalid: layout {layout.describe()} "
            f"expected {layout.world_size} workers"
        )
    job.train.per_worker_batch(layout.dp)
    layout.layers_per_stage(job.model.num_layers)
    speeds = speeds or [1.0] * scaling.num_workers
    if len(speeds) != scaling.num_workers or min(speeds) <= 0:
        raise ValueError(f"emulated_speeds={speeds!r} is invalid: expected {scaling.num_workers} positive numbers")
    return speeds


def _build_engines(group: WorkerGroup, job: TrainJob, layout: ParallelLayout, speeds: list[float]) -> None:
    reports = group.call_each("build_engine", [(job, layout, speed) for speed in speeds])
    fingerprints = {report["corpus"] for report in reports}
    if len(fingerprints) != 1:
        # Nodes with different Python versions read different stdlib sources.
        raise ClusterError(f"workers built different corpora {sorted(fingerprints)}; use one Python version")


def _train(group: WorkerGroup, job: TrainJob, run: RunConfig) -> list[StepMetrics]:
    metrics: list[StepMetrics] = []
    with TrainingProgress(job.train.num_steps, enabled=run.show_progress) as progress:
        for step in range(job.train.num_steps):
            step_started = time.perf_counter()
            per_rank = group.call("train_step", step)
            step_metrics = reduce_step_metrics(per_rank, time.perf_counter() - step_started)
            if step % job.train.log_every == 0 or step == job.train.num_steps - 1:
                metrics.append(step_metrics)
            progress.update(step_metrics)
    return metrics
