"""Placing the pool's bookkeeping actors on the head node: the elastic controller, the serving registry,
the RL rollout board. They hold what the pool's other processes coordinate through (who trains, which
weights replicas serve), need no resources, and must outlive the loss of any worker node; the head
node's loss ends the Ray cluster anyway."""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray gives the head node this resource (a little of it is asked
# by a Serve deployment that must run there: deployments take resources, not a scheduling strategy)


def head_node_id() -> str:
    """The Ray head node's id (the driver's own node is ambiguous when simulated nodes share one IP)."""
    for node in ray.nodes():
        if node["Alive"] and HEAD_NODE_RESOURCE in node["Resources"]:
            return node["NodeID"]
    return ray.get_runtime_context().get_node_id()


def on_head_node() -> NodeAffinitySchedulingStrategy:
    """Hard affinity to the head node: Ray's soft affinity placed such actors on other nodes in practice."""
    return NodeAffinitySchedulingStrategy(head_node_id(), soft=False)
