"""`layout="auto"`: ask the planner for a layout on the live cluster's resource graph.

Planning is pure arithmetic over the graph; this module only gathers the graph
(descriptor-matched in simulation, probed otherwise) and converts the planner's
`PlacementPlan` into the `ParallelLayout` the engines execute.
"""

from __future__ import annotations

import numpy as np

from baige_ray.engines.train_job import TrainJob
from baige_ray.parallel.layout import RECOMPUTE_KINDS, ParallelLayout
from baige_ray.planner.options import PlanOptions
from baige_ray.planner.plan import PlacementPlan, plan
from baige_ray.topology.descriptor import ClusterDescriptor
from baige_ray.topology.graph import ResourceGraph
from baige_ray.topology.simulated import SimulatedCluster

# DeepSpeed, as the engines configure it, overlaps gradient reductions with backward only under ZeRO-3
# (its overlap_comm default); DDP always overlaps its buckets.
ENGINE_OVERLAPPED_ZERO_STAGES = (0, 3)


def live_graph(descriptor: ClusterDescriptor | None = None) -> ResourceGraph:
    """The graph of the Ray cluster this driver is connected to."""
    from baige_ray.topology.live import LiveTopology

    if descriptor is None and SimulatedCluster.active() is not None:
        descriptor = SimulatedCluster.active().descriptor
    return LiveTopology(descriptor=descriptor).graph()


def first_devices(graph: ResourceGraph, num_devices: int) -> ResourceGraph:
    """Keep the first `num_devices` devices in node order, so whole nodes are used first."""
    if graph.num_devices < num_devices:
        raise ValueError(
            f"ScalingConfig.num_workers={num_devices} is invalid: the cluster graph has {graph.num_devices} devices"
        )
    return graph.without_devices(np.asarray(graph.device_ids)[num_devices:])


def plan_job(job: TrainJob, graph: ResourceGraph) -> PlacementPlan:
    """The planner's pick for the job, priced with this hardware's kept calibration where there is one."""
    from baige_ray.runtime.calibration_store import load_calibration

    spec = job.plugin.model_spec(global_batch=job.train.global_batch_size)
    # The recomputation the engines run: full, for dense models (an MoE block's forward counts its auxiliary
    # loss and routed tokens, so it is not run twice)
    recompute = ("none",) if spec.is_moe else RECOMPUTE_KINDS
    return plan(spec, graph, PlanOptions(expert_parallel_zero_stages=(0, 1, 2), max_pp=job.plugin.max_pipeline_stages,
                                         overlapped_zero_stages=ENGINE_OVERLAPPED_ZERO_STAGES, recompute=recompute,
                                         calibration=load_calibration(graph)))


def layout_from_plan(placement: PlacementPlan) -> ParallelLayout:
    """ZeRO without TP/PP runs on DeepSpeed, but ZeRO-3 with CP, TP or PP maps to FSDP2 (torchtitan's
    composition); ZeRO-1/2 with TP or PP to DDP (DeepSpeed runs neither here)."""
    composed = placement.tp > 1 or placement.pp > 1
    if placement.zero_stage == 3 and (composed or placement.cp > 1):
        data_parallel = "fsdp2"
    elif placement.zero_stage > 0 and not composed:
        data_parallel = f"zero{placement.zero_stage}"
    else:
        data_parallel = "ddp"
    return ParallelLayout(
        dp=placement.dp // placement.cp,
        cp=placement.cp,
        cp_kind=placement.cp_kind,
        tp=placement.tp,
        pp=placement.pp,
        ep=placement.ep,
        data_parallel=data_parallel,
        num_microbatches=placement.num_micro_batches if placement.pp > 1 else None,
        # The engines attend through SDPA's fused kernel, which keeps no attention scores: what selective
        # recomputation would spare is never stored, so it runs as none
        recompute="none" if placement.recompute == "selective" else placement.recompute,
        stage_layers=tuple(placement.stage_layers) if placement.pp > 1 else None,
    )
