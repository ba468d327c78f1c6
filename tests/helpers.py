"""Shared test helpers: single-process references and worker classes with injected misbehaviour."""

from __future__ import annotations

import socket
from contextlib import contextmanager

from baige_ray.actors.worker import WorkerActor
from baige_ray.engines.factory import build_engine
from baige_ray.engines.train_job import TrainJob
from baige_ray.parallel.layout import ParallelLayout

# Ranks are forked from a server process that imported these once per pytest process, instead of each
# new rank importing them again: 3-6 s of CPU a rank on this machine, most of what a two-rank test costs.
RANK_PRELOAD = ["torch", "torch.distributed", "transformers.modeling_utils"]


def rank_context():
    """The multiprocessing context that new ranks start from: forked from a server holding RANK_PRELOAD."""
    import multiprocessing

    multiprocessing.set_forkserver_preload(RANK_PRELOAD)  # read when the server starts, at the first use
    return multiprocessing.get_context("forkserver")


def spawn_ranks(rank_main, nprocs: int, *args) -> dict:
    """Run `rank_main(rank, port, results, *args)` in `nprocs` new processes (a gloo group's ranks,
    MASTER_PORT a free port of 127.0.0.1); returns what each rank put in `results[rank]`."""
    import torch.multiprocessing as mp

    rank_context()
    port = free_port()
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(rank_main, args=(port, results, *args), nprocs=nprocs, start_method="forkserver")
        return dict(results)


def at_full_speed(layout: ParallelLayout):
    """The execution plan of `layout` with every chip at its own speed (no emulated slow chips)."""
    from baige_ray.jobs.fit import ExecutionPlan

    return ExecutionPlan(layout=layout, emulated_speeds=(1.0,) * layout.world_size)


def worker_group(num_workers: int):
    """A fixture body: `num_workers` worker actors, shut down after the module's tests."""
    from baige_ray.api.configs import ScalingConfig
    from baige_ray.jobs.worker_group import WorkerGroup

    workers = WorkerGroup(ScalingConfig(num_workers=num_workers), timeout_s=240)
    yield workers
    workers.shutdown()


def reference_losses(job: TrainJob, num_steps: int | None = None) -> list[float]:
    """Losses of one process holding the whole model and the whole global batch."""
    engine = build_engine(job, ParallelLayout())
    return [engine.train_step(step)["loss"] for step in range(num_steps or job.train.num_steps)]


class FailingStepWorker(WorkerActor):
    """A worker whose `train_step` raises on one rank at one step."""

    fail_rank = 1
    fail_step = 1

    def train_step(self, step: int) -> dict[str, float]:
        membership = self._require_membership()
        if membership.rank == self.fail_rank and step == self.fail_step:
            raise RuntimeError(f"injected failure at rank {membership.rank}, step {step}")
        return super().train_step(step)


def elastic_mlp_job(num_steps: int, global_batch_size: int = 24, sizes=(64, 128, 32)) -> TrainJob:
    """The recovery scenario's MLP (smaller) at a constant learning rate."""
    from baige_ray.api.configs import TrainConfig
    from baige_ray.models.mlp import MLPConfig

    return TrainJob(model=MLPConfig(sizes=sizes),
                    train=TrainConfig(num_steps=num_steps, global_batch_size=global_batch_size, learning_rate=0.05,
                                      min_learning_rate=0.05, warmup_steps=0, grad_clip=0.0))


def elastic_mlp_run(name: str, storage_path, *, num_workers: int = 4, num_steps: int = 15, faults=None,
                    elastic=None, global_batch_size: int = 24, sizes=(64, 128, 32)):
    """Start elastic_mlp_job as an elastic job; returns the TrainingJob."""
    from baige_ray.api.configs import RunConfig, ScalingConfig
    from baige_ray.api.elastic import ElasticConfig
    from baige_ray.jobs.launch import launch

    job = elastic_mlp_job(num_steps, global_batch_size, sizes)
    return launch(
        job.model,
        train=job.train,
        scaling=ScalingConfig(num_workers=num_workers),
        run=RunConfig(name=name, storage_path=storage_path, show_progress=False),
        elastic=elastic or ElasticConfig(num_spares=1),
        faults=faults,
    )


def reference_parameters(job: TrainJob) -> dict:
    """Final parameters of one process holding the whole model and the whole global batch."""
    engine = build_engine(job, ParallelLayout())
    for step in range(job.train.num_steps):
        engine.train_step(step)
    return engine.export_state()["model"]


def final_parameters(result) -> dict:
    import ray

    return ray.get(result.final_state)["model"]


def kill_runs_named(prefix: str) -> int:
    """Kill what every run whose name starts with `prefix` left behind (a failed test's detached actors)."""
    import ray

    from baige_ray.elastic.workers import NAMESPACE
    from baige_ray.jobs.launch import kill_run_actors

    runs = {entry["name"].split(":")[1] for entry in ray.util.list_named_actors(all_namespaces=True)
            if entry["namespace"] == NAMESPACE and entry["name"].startswith(("baige-worker:", "baige-controller:"))
            and entry["name"].split(":")[1].startswith(prefix)}
    return sum(kill_run_actors(run) for run in runs)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def devices_held(cluster, indices):
    """Every device of the simulated nodes `indices` held by a placement group, as another job would hold
    them: a job on the other nodes then finds the cluster full (it shrinks on a node's loss instead of
    growing elsewhere) without starting the processes of a full-size job."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from baige_ray.topology.simulated import NODE_INDEX_RESOURCE

    bundles = [{"GPU": float(cluster.descriptor.node_types[cluster.node_type_of(index)].num_devices),
                NODE_INDEX_RESOURCE.format(index=index): 1.0} for index in indices]
    group = placement_group(bundles, strategy="SPREAD")
    ray.get(group.ready(), timeout=60)
    try:
        yield
    finally:
        remove_placement_group(group)
