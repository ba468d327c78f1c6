"""A readable and a JSON summary of a ResourceGraph: nodes, islands, rails, tiers with bandwidths."""

from __future__ import annotations

from typing import Any

import numpy as np

from baige_ray.topology.graph import LinkTier, ResourceGraph


def summarize_graph(graph: ResourceGraph) -> dict[str, Any]:
    d = graph.devices
    islands = graph.islands()
    return {
        "name": graph.name,
        "num_nodes": graph.num_nodes,
        "num_devices": graph.num_devices,
        "num_islands": len(islands),
        "island_sizes": sorted({len(i) for i in islands}),
        "rails": {str(rail): len(ids) for rail, ids in graph.rails().items()},
        "num_leaves": len(graph.leaves()),
        "num_pods": len(graph.pods()),
        "cpu_only_nodes": graph.cpu_only_nodes().tolist(),
        "node_types": _node_types(graph),
        "tiers": tier_table(graph),
        "total_memory_gb": float(d.memory_gb.sum(dtype=np.float64)),
        "total_relative_speed": float(d.speed.sum(dtype=np.float64)),
    }


def _node_types(graph: ResourceGraph) -> list[dict[str, Any]]:
    counts = np.bincount(graph.nodes.profile, minlength=len(graph.profiles))
    return [
        {"name": p.name, "nodes": int(n), "devices_per_node": p.num_devices, "chip": p.chip_model,
         "memory_gb": p.device_memory_gb, "relative_speed": p.relative_speed, "fabric": p.fabric}
        for p, n in zip(graph.profiles, counts) if n > 0
    ]


def tier_table(graph: ResourceGraph) -> list[dict[str, Any]]:
    """For each tier present in the graph: one device pair at that tier and its bandwidth range."""
    rows = []
    for tier, pairs in _sample_pairs(graph).items():
        a, b = np.array(pairs).T
        bandwidth = np.atleast_1d(graph.bandwidth_between(a, b))
        latency = np.atleast_1d(graph.latency_between(a, b))
        rows.append({"tier": tier.name, "min_gb_per_s": float(bandwidth.min()),
                     "max_gb_per_s": float(bandwidth.max()), "latency_us": float(latency.max())})
    return rows


def _sample_pairs(graph: ResourceGraph) -> dict[LinkTier, list[tuple[int, int]]]:
    """Device pairs that exhibit each tier, from a few representative nodes.

    The first two nodes of every node type, plus the first node of the first two
    leaf groups and pods, cover every tier the graph has while keeping the pair
    count tiny at 100,000 devices.
    """
    node_ids, profile = graph.nodes.node_id, graph.nodes.profile
    chosen = {int(i) for p in range(len(graph.profiles)) for i in node_ids[profile == p][:2]}
    for level in (graph.devices.leaf, graph.devices.pod):
        _, first = np.unique(level, return_index=True)
        chosen |= {int(n) for n in graph.devices.node[first[:2]]}
    sample = [int(x) for node in sorted(chosen) for x in graph.devices_of_node(node)[:16]]
    if len(sample) < 2:
        return {}
    a, b = np.array([(x, y) for i, x in enumerate(sample) for y in sample[i + 1:]]).T
    tiers = np.atleast_1d(graph.tier_between(a, b))
    return {tier: list(zip(a[tiers == tier].tolist(), b[tiers == tier].tolist()))
            for tier in LinkTier if (tiers == tier).any()}


def render_text(summary: dict[str, Any]) -> str:
    lines = [
        f"cluster {summary['name']}: {summary['num_nodes']} nodes, {summary['num_devices']} devices, "
        f"{summary['num_islands']} NVLink islands (sizes {summary['island_sizes']}), "
        f"{len(summary['rails'])} rails, {summary['num_leaves']} leaf groups, {summary['num_pods']} pods",
    ]
    for t in summary["node_types"]:
        lines.append(f"  node type {t['name']}: {t['nodes']} x {t['devices_per_node']} {t['chip']} "
                     f"({t['memory_gb']:g} GB, speed {t['relative_speed']:g}, {t['fabric']})")
    if summary["cpu_only_nodes"]:
        lines.append(f"  CPU-only nodes: {summary['cpu_only_nodes']}")
    if summary["rails"]:
        lines.append("  rails: " + ", ".join(f"{r}: {n} devices" for r, n in summary["rails"].items()))
    lines.append("  link tiers (GB/s per direction):")
    for row in summary["tiers"]:
        span = (f"{row['min_gb_per_s']:.4g}" if row["min_gb_per_s"] == row["max_gb_per_s"]
                else f"{row['min_gb_per_s']:.4g}-{row['max_gb_per_s']:.4g}")
        lines.append(f"    {row['tier']:<10} {span:>12} GB/s  {row['latency_us']:g} us")
    return "\n".join(lines)
