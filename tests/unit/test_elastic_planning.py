"""The planner-driven elastic layout: devices of workers, rank order, re-planning after a loss (no Ray)."""

from __future__ import annotations

import numpy as np
import pytest

from baige_ray.api.configs import TrainConfig
from baige_ray.api.device import DeviceInfo
from baige_ray.elastic.planning import ElasticPlanner, rank_order, worker_devices
from baige_ray.elastic.workers import Worker
from baige_ray.engines.train_job import TrainJob
from baige_ray.models.corpus import CorpusConfig
from baige_ray.models.gpt import GPTConfig
from baige_ray.models.mlp import MLPConfig
from baige_ray.topology.descriptor import load_descriptor
from baige_ray.topology.graph import ResourceGraph
from tests.conftest import SIM_4X2

NODE_NAMES = {0: "ray-node-a", 1: "ray-node-b", 2: "ray-node-c", 3: "ray-node-d"}


def graph_4x2() -> ResourceGraph:
    return ResourceGraph.from_descriptor(load_descriptor(SIM_4X2)).with_node_names(NODE_NAMES)


def worker(node: int, index: int) -> Worker:
    info = DeviceInfo(node_id=NODE_NAMES[node], node_ip="127.0.0.1", hostname="h", pid=1, device_kind="cuda",
                      device_index=index, device_name="sim", memory_bytes=0, ray_resource="GPU", simulated=True)
    return Worker(actor=None, name=f"w{node}{index}", info=info)


def job(model=None) -> TrainJob:
    # Wide enough that the planner spreads it over several devices.
    model = model or GPTConfig(num_layers=8, hidden=1024, num_heads=16, seq_len=512)
    return TrainJob(model=model, train=TrainConfig(num_steps=4, global_batch_size=96, micro_batch_size=2),
                    data=CorpusConfig())


class FixedGraphPlanner(ElasticPlanner):
    def __init__(self, *args, graph: ResourceGraph, **kwargs):
        super().__init__(*args, **kwargs)
        self.fixed_graph = graph

    def graph(self) -> ResourceGraph:
        return self.fixed_graph


def test_worker_devices_maps_node_and_index_to_graph_device_ids():
    graph = graph_4x2()
    ids = worker_devices(graph, [worker(2, 1).info, worker(0, 0).info, worker(3, 0).info])
    assert ids.tolist() == [5, 0, 6]


@pytest.mark.parametrize("bad, message", [(worker(1, 2), "device 2"), (worker(1, 0), "two workers")])
def test_worker_devices_rejects_unknown_devices_and_duplicates(bad, message):
    with pytest.raises(LookupError, match=message):
        worker_devices(graph_4x2(), [worker(1, 0).info, bad.info])


def test_worker_devices_rejects_a_node_missing_from_the_graph():
    graph = graph_4x2().without_nodes([3])
    with pytest.raises(LookupError, match="not in the resource graph"):
        worker_devices(graph, [worker(3, 0).info])


def test_rank_order_follows_the_plans_devices_and_lists_the_idle_ones():
    class Plan:
        rank_to_device = np.array([6, 2, 3])

    ranks, unused = rank_order(Plan(), np.array([2, 3, 4, 6]))
    assert ranks == [3, 0, 1]
    assert unused == [2]


def test_arrange_lays_out_every_worker_in_the_plans_rank_order():
    workers = [worker(node, index) for node in range(4) for index in range(2)][::-1]  # order must not matter
    planner = FixedGraphPlanner(job(), None, graph=graph_4x2())
    arrangement = planner.arrange(workers)
    assert arrangement.layout.world_size == len(arrangement.members) > 1
    assert sorted(w.name for w in arrangement.members + arrangement.unused) == sorted(w.name for w in workers)
    devices = worker_devices(graph_4x2(), [w.info for w in arrangement.members])
    assert devices.tolist() == arrangement.plan.rank_to_device.tolist()


def test_after_a_node_is_lost_the_replan_uses_only_surviving_devices():
    workers = [worker(node, index) for node in range(4) for index in range(2)]
    planner = FixedGraphPlanner(job(), None, graph=graph_4x2())
    planner.commit(planner.arrange(workers))
    survivors = [w for w in workers if w.info.node_id != NODE_NAMES[1]]
    planner.fixed_graph = graph_4x2().without_nodes([1])
    after = planner.arrange(survivors)
    names = {w.name for w in after.members}
    assert names <= {w.name for w in survivors} and after.layout.world_size == len(after.members)
    assert planner.plan is not after.plan  # not adopted until committed


def test_the_planner_refuses_models_it_cannot_price():
    with pytest.raises(ValueError, match="layout='auto' is invalid for MLPConfig"):
        ElasticPlanner(job(MLPConfig()), None)
