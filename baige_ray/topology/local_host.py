"""This machine as a one-node resource graph, for CPU workers on a cluster that has no descriptor.

A probed node lists its accelerators, not CPU "devices"; where workers take CPU slots of the one machine
the driver runs on (a local `ray.init`, a single-node `ray start`), each worker is a device whose memory
is the host's, and all of them share it.
"""

from __future__ import annotations

import os
import socket

import psutil

from baige_ray.topology.descriptor import descriptor_from_dict
from baige_ray.topology.graph import ResourceGraph


def local_host_graph(num_devices: int, *, chip: dict | None = None, accelerator: str = "cpu") -> ResourceGraph:
    """This host as one node of `num_devices` devices: CPU devices sharing its memory by default, or
    `chip` (model, memory_gb) on `accelerator`."""
    memory_gb = psutil.virtual_memory().total / 1e9
    node = {"accelerator": accelerator, "num_devices": num_devices, "num_cpus": os.cpu_count() or 1,
            "memory_gb": memory_gb, "chip": chip or {"model": "host-cpu", "memory_gb": memory_gb},
            "intra_node": {"fabric": "none", "bandwidth_gbps": 100}}
    return ResourceGraph.from_descriptor(descriptor_from_dict(
        {"name": "this-host", "node_types": {"host": node}, "nodes": [{"type": "host", "count": 1}]}))


def is_this_host(ray_nodes: list[dict]) -> bool:
    """Whether the alive nodes of a Ray cluster (`ray.nodes()`) are this one machine alone."""
    alive = [node for node in ray_nodes if node.get("Alive")]
    return len(alive) == 1 and alive[0].get("NodeManagerHostname") == socket.gethostname()
