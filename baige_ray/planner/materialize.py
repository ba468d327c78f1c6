"""A plan as Ray placement groups: one STRICT_PACK group per node, one bundle per device.

The pure part (`bundle_layout`) decides which bundles each node's group holds and which
(group, bundle) every rank gets; only `materialize` touches Ray. A bundle asks for one
device, some CPU and, where the cluster advertises it (simulated clusters do, see
`baige_ray.topology.simulated.node_resources`), a sliver of the node's marker resource,
which pins the group to the node the plan chose rather than any node with free devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from baige_ray.planner.plan import PlacementPlan
from baige_ray.topology.simulated import NODE_INDEX_RESOURCE

# A marker unit per bundle small enough for 1,000 devices on a node with the marker's 1.0.
NODE_MARKER_PER_BUNDLE = 0.001


@dataclass(kw_only=True, frozen=True)
class NodeBundles:
    node_id: int
    ranks: tuple[int, ...]  # bundle i holds ranks[i]
    bundles: tuple[dict[str, float], ...]


@dataclass(kw_only=True, frozen=True, eq=False)
class BundleLayout:
    groups: tuple[NodeBundles, ...]
    rank_bundle: np.ndarray  # (num_ranks, 2): placement group index, bundle index


def bundle_layout(plan: PlacementPlan, *, device_resource: str = "GPU", cpus_per_device: float = 1.0,
                  node_resource: str | None = NODE_INDEX_RESOURCE) -> BundleLayout:
    """Group ranks by node (in node order), one bundle per rank, bundles in rank order inside a node."""
    rank_bundle = np.zeros((plan.num_ranks, 2), dtype=np.int64)
    groups = []
    for index, node in enumerate(np.unique(plan.rank_to_node)):
        ranks = np.flatnonzero(plan.rank_to_node == node)
        bundle: dict[str, float] = {device_resource: 1.0}
        if cpus_per_device > 0:
            bundle["CPU"] = cpus_per_device
        if node_resource:
            bundle[node_resource.format(index=int(node))] = NODE_MARKER_PER_BUNDLE
        groups.append(NodeBundles(node_id=int(node), ranks=tuple(int(r) for r in ranks),
                                  bundles=tuple(dict(bundle) for _ in ranks)))
        rank_bundle[ranks, 0] = index
        rank_bundle[ranks, 1] = np.arange(len(ranks))
    return BundleLayout(groups=tuple(groups), rank_bundle=rank_bundle)


@dataclass(kw_only=True, frozen=True, eq=False)
class MaterializedPlan:
    plan: PlacementPlan
    layout: BundleLayout
    placement_groups: tuple[Any, ...]

    def placement(self, rank: int) -> tuple[Any, int]:
        """(placement group, bundle index) of a rank."""
        group, bundle = self.layout.rank_bundle[rank]
        return self.placement_groups[int(group)], int(bundle)

    def scheduling_strategy(self, rank: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group, bundle = self.placement(rank)
        return PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=bundle)

    def release(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for group in self.placement_groups:
            remove_placement_group(group)


def materialize(plan: PlacementPlan, *, device_resource: str = "GPU", cpus_per_device: float = 1.0,
                node_resource: str | None = NODE_INDEX_RESOURCE, timeout_s: float = 60.0) -> MaterializedPlan:
    """Create and wait for the placement groups; on timeout remove them and raise ClusterError."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from baige_ray.api.errors import ClusterError

    layout = bundle_layout(plan, device_resource=device_resource, cpus_per_device=cpus_per_device,
                           node_resource=node_resource)
    groups = tuple(placement_group(list(g.bundles), strategy="STRICT_PACK", name=f"baige-node-{g.node_id}")
                   for g in layout.groups)
    ready, _ = ray.wait([g.ready() for g in groups], num_returns=len(groups), timeout=timeout_s)
    if len(ready) < len(groups):
        for group in groups:
            remove_placement_group(group)
        raise ClusterError(f"placement groups for {plan.num_ranks} ranks on {len(groups)} nodes were not ready "
                           f"within {timeout_s:.0f} s: the cluster lacks the devices or node resources the plan needs")
    return MaterializedPlan(plan=plan, layout=layout, placement_groups=groups)
