"""`fit`: train a model on worker actors spread over the Ray cluster.

This first version runs data parallelism (DDP) over `ScalingConfig.num_workers`
actors in one placement group. The driver only orchestrates: it forms the
process group, triggers each step on every worker, reduces their metrics, and
writes the final weights it receives through the object store.
"""

from __future__ import annotations

import logging
import time

import ray

from baige_ray.api.configs import RunConfig, ScalingConfig, TrainConfig
from baige_ray.api.errors import ClusterError
from baige_ray.api.result import Result, StepMetrics
from baige_ray.models.corpus import CorpusConfig
from baige_ray.models.gpt import GPTConfig
from baige_ray.runtime.checkpoint_io import save_model_checkpoint
from baige_ray.runtime.progress import TrainingProgress
from baige_ray.runtime.train_loop import TrainJob
from baige_ray.runtime.worker_group import WorkerGroup

logger = logging.getLogger(__name__)


def reduce_step_metrics(per_rank: list[dict[str, float]], step_time_s: float) -> StepMetrics:
    """Every rank handles the same number of samples, so the global loss is the plain mean."""
    return StepMetrics(
        step=int(per_rank[0]["step"]),
        loss=sum(m["loss"] for m in per_rank) / len(per_rank),
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
) -> Result:
    """Train `model` (the reference GPT by default) and return its metrics and final checkpoint.

    Connects to RAY_ADDRESS, or starts a local Ray, when no Ray session is open.
    """
    job = TrainJob(model=model or GPTConfig(), train=train, corpus=corpus or CorpusConfig())
    scaling = scaling or ScalingConfig()
    run = run or RunConfig()
    train.per_worker_batch(scaling.num_workers)  # fail on an uneven split before starting actors
    if not ray.is_initialized():
        ray.init(logging_level=logging.WARNING)
    started = time.perf_counter()
    group = WorkerGroup(scaling, timeout_s=run.step_timeout_s)
    try:
        group.form_process_group()
        _build_trainers(group, job)
        metrics = _train(group, job, run)
        checkpoint = save_model_checkpoint(
            run.run_dir / "final", group.call_rank(0, "model_state"), model_config=job.model, step=train.num_steps
        )
    finally:
        group.shutdown()
    return Result(
        metrics=metrics,
        checkpoint_path=checkpoint,
        workers=group.device_infos,
        elapsed_s=time.perf_counter() - started,
    )


def _build_trainers(group: WorkerGroup, job: TrainJob) -> None:
    reports = group.call("build_trainer", job)
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
