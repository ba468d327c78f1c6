"""Match live Ray nodes to graph nodes. Pure functions over `ray.nodes()` entries (dicts).

Simulated nodes carry custom resources `baige_node_{index}` and
`baige_type_{name}` (see simulated.py); their descriptor index is their graph
node id. Real nodes get ids in order of first sight and keep them, so a node
leaving never renumbers the others (leaves and pods follow node ids).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

_NODE_INDEX = re.compile(r"^baige_node_(\d+)$")
_NODE_TYPE = re.compile(r"^baige_type_(.+)$")


@dataclass(kw_only=True, frozen=True)
class SimulatedNode:
    index: int
    node_type: str
    ray_node_id: str


def alive_nodes(ray_nodes: Iterable[Mapping]) -> list[Mapping]:
    return [node for node in ray_nodes if node.get("Alive", node.get("alive", False))]


def simulated_nodes(ray_nodes: Iterable[Mapping], known_types: Iterable[str]) -> dict[int, SimulatedNode]:
    """Descriptor index -> node, for alive Ray nodes carrying the simulation markers.

    A node of an unknown type, or two live nodes claiming one index, is an error:
    both mean the cluster was not started from this descriptor.
    """
    known = set(known_types)
    found: dict[int, SimulatedNode] = {}
    for node in alive_nodes(ray_nodes):
        resources = node.get("Resources", {})
        index = next((int(m.group(1)) for key in resources if (m := _NODE_INDEX.match(key))), None)
        node_type = next((m.group(1) for key in resources if (m := _NODE_TYPE.match(key))), None)
        if index is None or node_type is None:
            continue
        if node_type not in known:
            raise ValueError(f"Ray node resource baige_type_{node_type} is invalid: expected one of {sorted(known)}")
        if index in found:
            raise ValueError(f"Ray node resource baige_node_{index} is invalid: expected one live node per index")
        found[index] = SimulatedNode(index=index, node_type=node_type, ray_node_id=node["NodeID"])
    return found


def assign_node_ids(ray_nodes: Iterable[Mapping], known: Mapping[str, int]) -> dict[str, int]:
    """Ray node id -> graph node id for alive nodes: known ids kept, new nodes numbered after the
    largest id ever handed out, in address order so one start-up gives one numbering."""
    assigned = {ray_id: node_id for ray_id, node_id in known.items()}
    next_id = max(known.values(), default=-1) + 1
    alive = sorted(alive_nodes(ray_nodes), key=lambda n: (n.get("NodeManagerAddress", ""), n["NodeID"]))
    for node in alive:
        if node["NodeID"] not in assigned:
            assigned[node["NodeID"]] = next_id
            next_id += 1
    alive_ids = {node["NodeID"] for node in alive}
    return {ray_id: node_id for ray_id, node_id in assigned.items() if ray_id in alive_ids}
