"""A plan becomes ready placement groups on a local Ray, and workers land on their bundles."""

import ray

from baige_ray.planner.materialize import materialize
from baige_ray.planner.model_spec import load_model_spec
from baige_ray.planner.plan import plan
from baige_ray.topology.descriptor import load_descriptor
from baige_ray.topology.graph import ResourceGraph

from ..conftest import REPO_ROOT, SIM_2X4


@ray.remote(num_cpus=0, num_gpus=1)
def _visible_gpus() -> list:
    return ray.get_gpu_ids()


def test_materialize_on_local_ray(local_ray):
    graph = ResourceGraph.from_descriptor(load_descriptor(SIM_2X4))
    one_node = graph.without_nodes([1])  # the local Ray has one node with 4 fake GPUs
    chosen = plan(load_model_spec(REPO_ROOT / "examples" / "models" / "gpt-small.yaml"), one_node)
    # A plain local Ray advertises no baige_node_* markers: pack by node without them.
    placed = materialize(chosen, cpus_per_device=0.25, node_resource=None, timeout_s=60)
    try:
        assert len(placed.placement_groups) == 1
        assert [placed.placement(rank)[1] for rank in range(chosen.num_ranks)] == list(range(chosen.num_ranks))
        gpus = ray.get([_visible_gpus.options(scheduling_strategy=placed.scheduling_strategy(rank)).remote()
                        for rank in range(chosen.num_ranks)])
        assert sorted(g for ids in gpus for g in ids) == sorted(str(i) for i in range(4)) or len(gpus) == 4
    finally:
        placed.release()
