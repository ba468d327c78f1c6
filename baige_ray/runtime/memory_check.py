"""Refuse, on the driver before any worker actor starts, an explicit layout whose memory does not fit.

The arithmetic is planner/fits.py; this module gathers what it prices: the model as the planner
sees it, the live resource graph (`live_graph`, workers on its first devices as `first_devices`
assumes) and what an elastic job keeps in host memory (planner/replicas.py). Where there is nothing
to price the run is not blocked, and the log says why: a model the planner has no spec for (its
plug-in's `model_spec` raises ValueError), CPU workers on a cluster of several nodes with neither a
descriptor nor a simulation (probed nodes list no CPU devices; the probe is skipped), a graph with fewer
devices than workers, or workers holding CPU slots beside the graph's accelerators. CPU workers on a
cluster that is this machine alone (a local `ray.init`, a single-node `ray start`) are priced against
this host, every worker's memory and snapshots in its memory.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import ray

from baige_ray.api.configs import ScalingConfig
from baige_ray.api.errors import LayoutMemoryError
from baige_ray.engines.train_job import TrainJob
from baige_ray.parallel.layout import ParallelLayout
from baige_ray.planner.fits import CPU_DEVICE, HostCopies, LayoutFit, check_fits, layout_shape
from baige_ray.planner.model_spec import ModelSpec
from baige_ray.planner.replicas import host_copies
from baige_ray.runtime.auto_plan import first_devices, live_graph
from baige_ray.runtime.resources import choose_device_resource
from baige_ray.topology.descriptor import ClusterDescriptor
from baige_ray.topology.graph import ResourceGraph
from baige_ray.topology.local_host import is_this_host, local_host_graph
from baige_ray.topology.simulated import SimulatedCluster

if TYPE_CHECKING:
    from baige_ray.api.elastic import ElasticConfig

logger = logging.getLogger(__name__)

# The engines keep fp32 weights, gradients and Adam moments under either precision (16 bytes a parameter, bf16
# mixed precision's masters included); activations take TrainConfig.compute_dtype_bytes (2 under bf16-mixed).
STATE_DTYPE_BYTES = 4


def check_layout_memory(job: TrainJob, scaling: ScalingConfig, layout: ParallelLayout, *,
                        cluster: ClusterDescriptor | None = None, elastic: ElasticConfig | None = None
                        ) -> LayoutFit | None:
    """LayoutMemoryError when `layout` does not fit the live cluster; what it needs, or None when unpriced."""
    model = _model_spec(job)
    if model is None:
        return None
    # accelerator="gpu" asks for GPUs whatever the cluster has now (WorkerGroup says if it has too few).
    resource = "GPU" if scaling.accelerator == "gpu" else choose_device_resource(scaling, ray.cluster_resources())
    world = layout.world_size
    if resource == "CPU" and cluster is None and SimulatedCluster.active() is None:
        # A probed node lists no CPU devices: nothing to price on other machines, so skip the probe.
        if not is_this_host(ray.nodes()):
            logger.info("memory of the layout not checked: CPU workers on a cluster without a descriptor")
            return None
        spares = elastic.num_spares if elastic is not None else 0
        graph = local_host_graph(world + spares)
        return _check(job, model, graph, layout, elastic, spares)
    graph = live_graph(cluster)
    if not _workers_hold_graph_devices(graph, resource, world):
        return None
    spares = min(elastic.num_spares, graph.num_devices - world) if elastic is not None else 0
    return _check(job, model, first_devices(graph, world + spares), layout, elastic, spares)


def _check(job: TrainJob, model: ModelSpec, graph: ResourceGraph, layout: ParallelLayout,
           elastic: ElasticConfig | None, spares: int) -> LayoutFit:
    try:
        return _fits(job, model, graph, layout, elastic, spares)
    except LayoutMemoryError as refusal:
        if refusal.budget != "device memory":
            raise
        hint = _context_parallel_hint(job, model, graph, layout, elastic, spares)
        if hint is None:
            raise
        raise LayoutMemoryError(f"{refusal}; {hint}", needed_gb=refusal.needed_gb, available_gb=refusal.available_gb,
                                layout=refusal.layout, budget=refusal.budget) from None


def _fits(job: TrainJob, model: ModelSpec, graph: ResourceGraph, layout: ParallelLayout,
          elastic: ElasticConfig | None, spares: int) -> LayoutFit:
    shape = layout_shape(layout, job.train, job.plugin.layers_per_stage(layout),
                         compute_dtype_bytes=job.train.compute_dtype_bytes)
    return check_fits(model, graph, shape, copies=_host_copies(layout, graph, elastic, spares))


def _context_parallel_hint(job: TrainJob, model: ModelSpec, graph: ResourceGraph, layout: ParallelLayout,
                           elastic: ElasticConfig | None, spares: int) -> str | None:
    """The smallest CP degree at which the same workers fit (data-parallel replicas traded for context-parallel
    ranks, each keeping a smaller share of every sequence), said as a remedy; None where none does or the model
    cannot run context parallelism."""
    if not job.plugin.supports_context_parallel:
        return None
    factor = 2
    while layout.dp % factor == 0:
        candidate = dataclasses.replace(layout, dp=layout.dp // factor, cp=layout.cp * factor)
        try:
            job.plugin.check_layout(candidate)
            fit = _fits(job, model, graph, candidate, elastic, spares)
        except (ValueError, LayoutMemoryError):  # the sequence does not split so, or it does not fit either
            factor *= 2
            continue
        return (f"with context parallelism it fits on the same {layout.world_size} workers: {candidate.describe()} "
                f"needs {max(fit.device_bytes) / 1e9:.1f} GB per device (ParallelLayout(cp={candidate.cp}, "
                f"dp={candidate.dp}, ...))")
    return None


def _model_spec(job: TrainJob) -> ModelSpec | None:
    try:
        return job.plugin.model_spec(global_batch=job.train.global_batch_size, dtype_bytes=STATE_DTYPE_BYTES)
    except ValueError as error:
        logger.info("memory of the layout not checked: %s", error)
        return None


def _workers_hold_graph_devices(graph: ResourceGraph, resource: str, world: int) -> bool:
    if graph.num_devices < world:
        logger.info("memory of the layout not checked: the resource graph %r has %d devices for %d workers",
                    graph.name, graph.num_devices, world)
        return False
    accelerators = any(p.accelerator != CPU_DEVICE and p.num_devices for p in graph.profiles)
    if accelerators and resource == "CPU":
        logger.info("memory of the layout not checked: its workers hold CPU slots, not the graph's accelerators")
        return False
    return True


def _host_copies(layout: ParallelLayout, graph: ResourceGraph, elastic: ElasticConfig | None,
                 spares: int) -> HostCopies:
    if elastic is None:
        return HostCopies()
    stages = [layout.coords(rank).pp for rank in range(layout.world_size)]
    nodes = [str(node) for node in graph.devices.node]
    return host_copies(stages, nodes, num_spares=spares, replicate=elastic.replicate_every > 0,
                       sharded=layout.snapshots_are_sharded, snapshot_slots=elastic.snapshot_slots)
