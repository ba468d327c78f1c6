"""Draw the hierarchy of a ResourceGraph as a PNG: pods -> leaf groups -> nodes -> islands -> devices.

Large clusters are drawn as a sample (the first few pods, leaves and nodes, with
"+N more" labels), since 2,048 nodes do not fit on a page and every leaf group
of a rail-optimized cluster looks the same. Devices are coloured by chip,
NVLink islands are outlined, and a coloured tick under each device shows its rail.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from baige_ray.topology.graph import ResourceGraph
from baige_ray.topology.summary import summarize_graph

MAX_PODS, MAX_LEAVES, MAX_NODES = 2, 2, 2


def render_png(graph: ResourceGraph, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    summary = summarize_graph(graph)
    pods = graph.pods()[:MAX_PODS]
    columns = _columns(graph, pods)
    width = max(len(columns), 1)
    fig, ax = plt.subplots(figsize=(max(8.0, 1.8 * width), 5.0))
    chip_colors = _palette([p.chip_model for p in graph.profiles], "tab10")
    rail_colors = _palette(sorted(graph.rails()), "Set2")
    for x, (pod, leaf, node) in enumerate(columns):
        _draw_node(ax, Rectangle, graph, node, x, chip_colors, rail_colors)
        ax.plot([x + 0.5, x + 0.5], [2.2, 3.0], color="grey", lw=1)
    _draw_groups(ax, Rectangle, columns, graph)
    _legend(ax, Rectangle, chip_colors, rail_colors)
    tiers = "; ".join(f"{row['tier']} {row['min_gb_per_s']:.4g} GB/s" for row in summary["tiers"])
    ax.set_title(f"{graph.name}: {graph.num_nodes} nodes, {graph.num_devices} devices, "
                 f"{summary['num_pods']} pods\n{tiers}", fontsize=10)
    ax.set_xlim(-0.3, width + 1.8)
    ax.set_ylim(0.6, 6.2)
    ax.axis("off")
    path = Path(path)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _columns(graph: ResourceGraph, pods: np.ndarray) -> list[tuple[int, int, int]]:
    """(pod, leaf, node) for each node drawn, sampled left to right."""
    node_ids = graph.nodes.node_id
    leaf_of = node_ids // graph.network.nodes_per_leaf
    pod_of = leaf_of // graph.network.leaves_per_pod
    columns = []
    for pod in pods:
        for leaf in np.unique(leaf_of[pod_of == pod])[:MAX_LEAVES]:
            for node in node_ids[leaf_of == leaf][:MAX_NODES]:
                columns.append((int(pod), int(leaf), int(node)))
    if not columns and len(node_ids):
        columns = [(int(pod_of[0]), int(leaf_of[0]), int(node_ids[0]))]
    return columns


def _draw_node(ax, Rectangle, graph: ResourceGraph, node: int, x: float, chip_colors, rail_colors) -> None:
    d = graph.devices
    ids = graph.devices_of_node(node)
    profile = graph.profile_of_node(node)
    ax.add_patch(Rectangle((x + 0.05, 0.8), 0.9, 1.4, fill=False, ec="black", lw=1))
    ax.text(x + 0.5, 2.05, f"node {node}", ha="center", va="top", fontsize=7)
    if len(ids) == 0:
        ax.text(x + 0.5, 1.0, "CPU only", ha="center", fontsize=7)
        return
    rows = int(np.ceil(len(ids) / 4))
    size = min(0.2, 1.6 / max(rows, 1))
    pos = graph.positions(ids)
    for k, p in enumerate(pos):
        cx, cy = x + 0.12 + (k % 4) * 0.2, 1.65 - (k // 4) * (size + 0.12)
        ax.add_patch(Rectangle((cx, cy), 0.16, size, color=chip_colors[profile.chip_model]))
        if d.rail[p] >= 0:
            ax.add_patch(Rectangle((cx, cy - 0.06), 0.16, 0.04, color=rail_colors[int(d.rail[p])]))
    for island in np.unique(d.island[pos]):
        members = np.flatnonzero(d.island[pos] == island)
        if len(members) > 1:
            top = min(members) // 4
            bottom = max(members) // 4
            ax.add_patch(Rectangle((x + 0.09, 1.65 - bottom * (size + 0.12) - 0.09), 0.82,
                                   (bottom - top) * (size + 0.12) + size + 0.13,
                                   fill=False, ec="tab:green", lw=1.2, ls="--"))


def _draw_groups(ax, Rectangle, columns, graph: ResourceGraph) -> None:
    for level, y, label in ((1, 3.0, "leaf"), (0, 4.2, "pod")):
        keys = [c[level] for c in columns]
        for key in dict.fromkeys(keys):
            xs = [i for i, k in enumerate(keys) if k == key]
            ax.add_patch(Rectangle((xs[0] + 0.05, y), len(xs) - 0.1, 0.6, fill=True, fc="whitesmoke", ec="black"))
            total = (graph.network.nodes_per_leaf if level == 1 else graph.network.leaves_per_pod)
            ax.text((xs[0] + xs[-1]) / 2 + 0.5, y + 0.3, f"{label} {key} ({total} {'nodes' if level else 'leaves'})",
                    ha="center", va="center", fontsize=7)
            ax.plot([(xs[0] + xs[-1]) / 2 + 0.5] * 2, [y + 0.6, y + 1.2], color="grey", lw=1)
    ax.add_patch(Rectangle((0.05, 5.4), max(len(columns), 1) - 0.1, 0.5, fc="lightsteelblue", ec="black"))
    hidden = len(graph.pods()) - len({c[0] for c in columns})
    ax.text(max(len(columns), 1) / 2, 5.65, "core / spine" + (f"  (+{hidden} more pods)" if hidden > 0 else ""),
            ha="center", va="center", fontsize=8)


def _legend(ax, Rectangle, chip_colors, rail_colors) -> None:
    handles = [Rectangle((0, 0), 1, 1, color=c) for c in chip_colors.values()]
    labels = [f"chip {m}" for m in chip_colors]
    handles += [Rectangle((0, 0), 1, 1, color=c) for c in rail_colors.values()]
    labels += [f"rail {r}" for r in rail_colors]
    handles.append(Rectangle((0, 0), 1, 1, fill=False, ec="tab:green", ls="--"))
    labels.append("NVLink island")
    ax.legend(handles, labels, loc="upper right", fontsize=7, frameon=False, ncol=1)


def _palette(keys, name: str) -> dict:
    import matplotlib

    cmap = matplotlib.colormaps[name]
    return {key: cmap(i % cmap.N) for i, key in enumerate(dict.fromkeys(keys))}
