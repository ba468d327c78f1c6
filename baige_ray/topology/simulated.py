"""A local multi-node Ray cluster that looks like a hardware descriptor.

Each descriptor node becomes a Ray node (`ray.cluster_utils.Cluster`) that
advertises fake accelerators plus custom resources naming its descriptor index,
node type and chip, so the topology layer can match Ray nodes to descriptor
nodes. Workers hold the fake accelerator and compute on CPU with gloo.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar

import ray
from ray.cluster_utils import Cluster

from baige_ray.accelerator import spec_for
from baige_ray.topology.descriptor import ClusterDescriptor, NodeType

NODE_INDEX_RESOURCE = "baige_node_{index}"
NODE_TYPE_RESOURCE = "baige_type_{name}"
CHIP_RESOURCE = "baige_chip_{model}"
_OBJECT_STORE_BYTES = 128 * 1024 * 1024


def node_resources(node_type: NodeType, index: int) -> dict[str, float]:
    """Custom resources that identify a simulated node; one unit of each marker."""
    return {
        NODE_INDEX_RESOURCE.format(index=index): 1.0,
        NODE_TYPE_RESOURCE.format(name=node_type.name): 1.0,
        CHIP_RESOURCE.format(model=node_type.chip.model): float(node_type.num_devices),
    }


def node_args(node_type: NodeType, index: int, cpus_per_device: float) -> dict:
    """Arguments for `Cluster.add_node` that make one descriptor node."""
    accelerator = spec_for(node_type.accelerator)
    resources = node_resources(node_type, index)
    args = {
        # CPU slots are what the fake devices need, not the descriptor's real core count:
        # every simulated node shares this machine's few cores.
        "num_cpus": max(1, int(node_type.num_devices * cpus_per_device) + 1),
        "object_store_memory": _OBJECT_STORE_BYTES,
        "resources": resources,
    }
    if accelerator.ray_resource == "GPU":
        args["num_gpus"] = node_type.num_devices
    elif accelerator.is_accelerator:
        resources[accelerator.ray_resource] = float(node_type.num_devices)
    return args


@dataclass
class SimulatedCluster:
    """Start with `start()` or a `with` block; `shutdown()` stops Ray and every node."""

    descriptor: ClusterDescriptor
    cpus_per_device: float = 1.0
    log_to_driver: bool = True  # False: workers' stdout and stderr stay in Ray's log files
    dashboard_port: int | None = None  # None: Ray's default (8265); another cluster on this machine needs its own
    _cluster: Cluster | None = None
    _worker_nodes: dict[int, Any] = field(default_factory=dict)
    # The running instance, so tests sharing one cluster through a fixture can grow and shrink it.
    _active: ClassVar[SimulatedCluster | None] = None

    @classmethod
    def active(cls) -> SimulatedCluster | None:
        return cls._active

    def start(self) -> SimulatedCluster:
        node_types = self.descriptor.node_type_sequence()
        head_args = node_args(node_types[0], 0, self.cpus_per_device)
        if self.dashboard_port is not None:
            head_args["dashboard_port"] = self.dashboard_port
        self._cluster = Cluster(initialize_head=True, head_node_args=head_args)
        for index, node_type in enumerate(node_types[1:], start=1):
            self._worker_nodes[index] = self._cluster.add_node(
                wait=False, **node_args(node_type, index, self.cpus_per_device))
        self._cluster.wait_for_nodes()
        ray.init(address=self._cluster.address, logging_level=logging.WARNING, log_to_driver=self.log_to_driver)
        SimulatedCluster._active = self
        return self

    def add_node(self, node_type: str, index: int) -> None:
        """Join one more node of a descriptor node type, advertising descriptor index `index`."""
        if self._cluster is None:
            raise RuntimeError("SimulatedCluster.add_node called before start()")
        if node_type not in self.descriptor.node_types:
            raise ValueError(f"node_type={node_type!r} is invalid: expected one of {sorted(self.descriptor.node_types)}")
        if index in self._worker_nodes or index == 0:
            raise ValueError(f"index={index} is invalid: expected an index not already in the cluster")
        args = node_args(self.descriptor.node_types[node_type], index, self.cpus_per_device)
        self._worker_nodes[index] = self._cluster.add_node(wait=True, **args)

    def remove_node(self, index: int) -> None:
        """Stop the node advertising descriptor index `index` (never the head node 0)."""
        if self._cluster is None:
            raise RuntimeError("SimulatedCluster.remove_node called before start()")
        self._cluster.remove_node(self._running_worker_node(index))
        del self._worker_nodes[index]

    def node_id_of(self, index: int) -> str:
        """The Ray node id of the running non-head node advertising descriptor index `index`."""
        return self._running_worker_node(index).node_id

    def _running_worker_node(self, index: int):
        if index not in self._worker_nodes:
            raise ValueError(f"index={index} is invalid: expected one of the running non-head nodes "
                             f"{sorted(self._worker_nodes)}")
        return self._worker_nodes[index]

    @property
    def worker_node_indices(self) -> list[int]:
        """Descriptor indices of the running non-head nodes."""
        return sorted(self._worker_nodes)

    def node_type_of(self, index: int) -> str:
        """The name of the descriptor's node type for node `index`."""
        names = [group.type for group in self.descriptor.nodes for _ in range(group.count)]
        if not 0 <= index < len(names):
            raise ValueError(f"index={index} is invalid: expected 0 <= index < {len(names)}")
        return names[index]

    @property
    def address(self) -> str:
        if self._cluster is None:
            raise RuntimeError("SimulatedCluster.address read before start()")
        return self._cluster.address

    def shutdown(self) -> None:
        if SimulatedCluster._active is self:
            SimulatedCluster._active = None
        ray.shutdown()
        if self._cluster is not None:
            self._cluster.shutdown()
            self._cluster = None
        self._worker_nodes.clear()

    def __enter__(self) -> SimulatedCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
