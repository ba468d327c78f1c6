"""`launch(layout="auto")`: the planner lays out the devices an elastic job's workers hold, and re-plans
each time that set changes (a failure, an eviction, a resize, capacity coming back).

Each worker reserves one device on its own, so the planner is asked about exactly those devices:
the live resource graph cut down to them. Its `PlacementPlan` fixes the degrees, the layer split and
which device serves which rank; workers are put in that rank order. Devices the plan leaves idle
(a small model may run best on fewer devices than it was given) stay with the job as warm spares.
After the first plan, `replan` prices keeping surviving ranks in place against a fresh plan, so a
change moves as little state as the cost model allows. State moves through the canonical form, so
any change of degrees or layer split is a reshard, not a restart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from baige_ray.api.device import DeviceInfo
from baige_ray.engines.train_job import TrainJob
from baige_ray.parallel.layout import ParallelLayout
from baige_ray.planner.plan import PlacementPlan
from baige_ray.planner.replan import replan
from baige_ray.runtime.auto_plan import layout_from_plan, plan_job
from baige_ray.topology.descriptor import ClusterDescriptor
from baige_ray.topology.graph import ResourceGraph


def worker_devices(graph: ResourceGraph, infos: Sequence[DeviceInfo]) -> np.ndarray:
    """The graph device id of each worker's device: its node (named by Ray node id) and its index there."""
    node_by_name = {name: int(node) for node, name in zip(graph.nodes.node_id, graph.nodes.names)}
    ids = []
    for info in infos:
        node = node_by_name.get(info.node_id)
        if node is None:
            raise LookupError(f"node {info.node_id[:12]} of a worker is not in the resource graph")
        devices = graph.devices_of_node(node)
        if not 0 <= info.device_index < len(devices):
            raise LookupError(f"device {info.device_index} of node {info.node_id[:12]} is not in the resource graph "
                              f"({len(devices)} devices there)")
        ids.append(int(devices[info.device_index]))
    if len(set(ids)) != len(ids):
        raise LookupError(f"two workers claim one device: {sorted(ids)}")
    return np.asarray(ids, dtype=np.int64)


def only_devices(graph: ResourceGraph, device_ids: np.ndarray) -> ResourceGraph:
    return graph.without_devices(np.setdiff1d(graph.device_ids, device_ids))


def rank_order(plan: PlacementPlan, device_ids: np.ndarray) -> tuple[list[int], list[int]]:
    """(index into `device_ids` of each rank's device, indices of devices the plan leaves unused)."""
    index_of = {int(device): i for i, device in enumerate(device_ids)}
    ranks = [index_of[int(device)] for device in plan.rank_to_device]
    used = set(ranks)
    return ranks, [i for i in range(len(device_ids)) if i not in used]


@dataclass(frozen=True)
class Arrangement:
    plan: PlacementPlan
    layout: ParallelLayout
    members: tuple[Any, ...]  # workers in rank order
    unused: tuple[Any, ...]  # workers the plan leaves idle
    repaired: bool  # surviving ranks kept their places
    reshard: bool  # degrees or layer split changed

    def describe(self) -> str:
        how = "kept surviving ranks in place" if self.repaired else "fresh plan"
        return f"planner: {self.layout.describe()} on {len(self.members)} devices ({how}); {len(self.unused)} idle"


class ElasticPlanner:
    """Plans on the live graph; `arrange` proposes, `commit` adopts once the workers regrouped."""

    def __init__(self, job: TrainJob, descriptor: ClusterDescriptor | None):
        job.plugin.model_spec(global_batch=job.train.global_batch_size)  # a model the planner cannot price fails here
        self.job = job
        self.descriptor = descriptor
        self.plan: PlacementPlan | None = None
        self._topology = None

    def graph(self) -> ResourceGraph:
        from baige_ray.topology.live import LiveTopology

        if self._topology is None:
            self._topology = LiveTopology(descriptor=self.descriptor)
        else:
            self._topology.refresh()
        return self._topology.graph()

    def arrange(self, workers: Sequence[Any]) -> Arrangement:
        graph = self.graph()
        devices = worker_devices(graph, [w.info for w in workers])
        sub = only_devices(graph, devices)
        if self.plan is None:
            chosen, repaired, reshard = plan_job(self.job, sub), False, True
        else:
            result = replan(self.plan, sub)
            chosen, repaired, reshard = result.plan, result.repaired, result.reshard
        ranks, unused = rank_order(chosen, devices)
        return Arrangement(plan=chosen, layout=layout_from_plan(chosen), members=tuple(workers[i] for i in ranks),
                           unused=tuple(workers[i] for i in unused), repaired=repaired, reshard=reshard)

    def commit(self, arrangement: Arrangement) -> None:
        self.plan = arrangement.plan
