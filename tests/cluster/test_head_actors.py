"""The pool's bookkeeping actors run on the head node, so that losing a worker node cannot take them.

Found by `bench soak`: the serving registry (the weights replicas serve, their load reports) was placed
by Ray on whichever node had room; a soak that stopped the worker node took it with it, and the served
application failed with "Failed to look up actor 'baige-serving:soak'" instead of replacing the replicas
it lost. The elastic controller was already pinned there; the registry and the RL rollout board now are.
"""

from __future__ import annotations

import pytest
import ray
from ray.util.state import get_actor

from baige_ray.api.connection import state_api_address
from baige_ray.rl.rollout_source import start_board
from baige_ray.serving.registry import get_or_create_registry
from baige_ray.topology.head import head_node_id

pytestmark = pytest.mark.cluster


def test_bookkeeping_actors_start_on_the_head_node(sim_cluster):
    if not sim_cluster.simulated:
        pytest.skip("needs the simulated cluster, whose worker nodes are not the head")
    # Unpinned, Ray put 2 of 8 such actors on the worker node here: 6 all on the head by chance would
    # be about 1 in 5.
    actors = [get_or_create_registry(f"head-test-{i}") for i in range(4)]
    actors += [start_board(f"head-test-{i}", 4) for i in range(2)]
    try:
        ray.get([actor.__ray_ready__.remote() for actor in actors])
        head = head_node_id()
        assert [get_actor(actor._actor_id.hex(), address=state_api_address()).node_id == head
                for actor in actors] == [True] * len(actors)
    finally:
        for actor in actors:
            ray.kill(actor)
