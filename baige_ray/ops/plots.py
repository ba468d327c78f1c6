"""PNG pictures of what the system decided: topology, rank placement, and devices held over time.

Topology reuses the resource-graph renderer (`baige_ray.topology.render`).
Placement draws each shown node as a row of devices, once per parallel dimension,
every device labelled with its rank and coloured by that rank's group. Timeline
draws the devices training and inference held over a run from its event log,
with failures and other incidents marked.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from baige_ray.planner.plan import PlacementPlan
from baige_ray.topology.graph import ResourceGraph

PANELS = (("tp", "tensor-parallel group"), ("dp", "data-parallel group"), ("pp", "pipeline stage"),
          ("ep", "expert-parallel group"))
# Incident kinds marked on the timeline: colour and line style.
INCIDENT_STYLES = {
    "failure": ("tab:red", "-"),
    "eviction": ("tab:orange", "--"),
    "straggler": ("goldenrod", ":"),
    "recovered": ("tab:green", ":"),
    "controller_restart": ("tab:purple", "-."),
    "failed": ("black", "-"),
}
JOB_END_KINDS = ("finished", "failed")
UNUSED = -1


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_topology(graph: ResourceGraph, out: str | Path) -> Path:
    """Nodes grouped by leaf and pod, devices per node, NVLink islands, rails and link tiers."""
    from baige_ray.topology.render import render_png

    Path(out).parent.mkdir(parents=True, exist_ok=True)
    return render_png(graph, out)


# ---- placement -------------------------------------------------------------------------


def rank_group_index(plan: PlacementPlan, dim: str) -> np.ndarray:
    """For every rank, the index of its group in dimension `dim` ("pp": its pipeline stage)."""
    if dim == "pp":
        return np.arange(plan.num_ranks) // (plan.tp * plan.dp)
    groups = plan.groups(dim)
    index = np.empty(plan.num_ranks, dtype=np.int64)
    index[groups] = np.arange(len(groups))[:, None]
    return index


def panel_dims(plan: PlacementPlan) -> list[str]:
    """Dimensions worth a panel: degree > 1 (data parallel when nothing is split)."""
    degrees = {"tp": plan.tp, "dp": plan.dp, "pp": plan.pp, "ep": plan.ep}
    return [dim for dim, _ in PANELS if degrees[dim] > 1] or ["dp"]


def sample_nodes(plan: PlacementPlan, graph: ResourceGraph, max_nodes: int) -> list[int]:
    """All nodes when they fit; else the nodes of rank 0's pipeline and data-parallel groups, alternating,
    so a sample of a large cluster still shows every kind of group crossing nodes."""
    if graph.num_nodes <= max_nodes:
        return [int(n) for n in graph.node_ids]
    along_pipeline = plan.rank_to_node[plan.groups("pp")[0]]
    along_data = plan.rank_to_node[plan.groups("dp")[0]]
    chosen: dict[int, None] = {}
    for pair in zip(along_pipeline, along_data):
        for node in pair:
            chosen.setdefault(int(node))
    for node in list(along_pipeline) + list(along_data) + list(graph.node_ids):
        chosen.setdefault(int(node))
    return sorted(list(chosen)[:max_nodes])


def placement_grid(plan: PlacementPlan, graph: ResourceGraph, nodes: list[int]) -> np.ndarray:
    """Rank on each (shown node, local device index); UNUSED where no rank runs."""
    width = max((len(graph.devices_of_node(n)) for n in nodes), default=0)
    grid = np.full((len(nodes), max(width, 1)), UNUSED, dtype=np.int64)
    rank_of_device = dict(zip(plan.rank_to_device.tolist(), range(plan.num_ranks)))
    for row, node in enumerate(nodes):
        for col, device in enumerate(graph.devices_of_node(node)):
            grid[row, col] = rank_of_device.get(int(device), UNUSED)
    return grid


def plot_placement(plan: PlacementPlan, graph: ResourceGraph, out: str | Path, *, max_nodes: int = 16) -> Path:
    """One panel per parallel dimension: nodes as rows, devices as cells, rank numbers, group colours."""
    plt = _pyplot()
    nodes = sample_nodes(plan, graph, max_nodes)
    grid = placement_grid(plan, graph, nodes)
    dims = panel_dims(plan)
    titles = dict(PANELS)
    fig, axes = plt.subplots(1, len(dims), figsize=(max(4.0, 0.45 * grid.shape[1] + 1.5) * len(dims),
                                                    max(2.8, 0.42 * len(nodes) + 1.8)), squeeze=False,
                             layout="constrained")
    for ax, dim in zip(axes[0], dims):
        _draw_panel(ax, grid, rank_group_index(plan, dim), nodes, f"{titles[dim]} ({dim}={_degree(plan, dim)})")
    shown = f"all {graph.num_nodes} nodes shown" if len(nodes) == graph.num_nodes else (
        f"{len(nodes)} of {graph.num_nodes} nodes shown: those of rank 0's pipeline and data-parallel groups")
    fig.suptitle(f"{plan.model.name} on {plan.cluster}: tp={plan.tp} pp={plan.pp} dp={plan.dp} ep={plan.ep}, "
                 f"mapping {plan.mapping}\n{plan.num_ranks:,} ranks; {shown}", fontsize=9)
    return _save(fig, plt, out)


def _degree(plan: PlacementPlan, dim: str) -> int:
    return {"tp": plan.tp, "dp": plan.dp, "pp": plan.pp, "ep": plan.ep}[dim]


def _draw_panel(ax, grid: np.ndarray, group_of_rank: np.ndarray, nodes: list[int], title: str) -> None:
    import matplotlib

    used = grid >= 0
    groups = np.where(used, group_of_rank[np.where(used, grid, 0)], UNUSED)
    # Colours in order of first appearance, so neighbouring groups in the picture differ.
    order = {g: i for i, g in enumerate(dict.fromkeys(int(g) for g in groups[used].ravel()))}
    cmap = matplotlib.colormaps["tab20"]
    image = np.ones(grid.shape + (4,))
    image[~used] = (0.92, 0.92, 0.92, 1.0)
    for (row, col), group in np.ndenumerate(groups):
        if group != UNUSED:
            image[row, col] = cmap(order[int(group)] % cmap.N)
    ax.imshow(image, aspect="auto", interpolation="nearest")
    font = 7 if grid.shape[1] <= 8 else 5
    for (row, col), rank in np.ndenumerate(grid):
        ax.text(col, row, "-" if rank == UNUSED else str(rank), ha="center", va="center", fontsize=font)
    ax.set_xticks(range(grid.shape[1]))
    ax.set_yticks(range(len(nodes)), [f"node {n}" for n in nodes], fontsize=7)
    ax.set_xlabel("device index in node", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title(f"{title}\n{len(order)} group{'s' if len(order) != 1 else ''} in view", fontsize=8)


# ---- timeline --------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceSeries:
    """Devices held over time, as steps: from times[i] on, train[i] and infer[i] hold until times[i + 1]."""

    start: float  # epoch seconds of the first event; times are seconds after it
    times: np.ndarray
    train: np.ndarray
    infer: np.ndarray


def device_series(events: list[dict[str, Any]]) -> DeviceSeries:
    """Device counts from events that carry them: `train_devices` / `infer_devices` (resize, lend, reclaim),
    or `num_workers` (one device per worker) for training when an event has no `train_devices`;
    training holds none after the job's finished / failed event.

    A count missing from an event keeps its previous value; the series ends at the last event.
    """
    ordered = sorted(events, key=lambda e: e["time"])
    start = float(ordered[0]["time"]) if ordered else 0.0
    times: list[float] = []
    counts: list[tuple[int, int]] = []
    current = (0, 0)
    for event in ordered:
        train = event.get("train_devices", event.get("num_workers"))
        if event.get("kind") in JOB_END_KINDS:
            train = 0  # a finished or failed job has released its workers
        if train is None and "infer_devices" not in event:
            continue
        current = (int(current[0] if train is None else train), int(event.get("infer_devices", current[1])))
        times.append(float(event["time"]) - start)
        counts.append(current)
    if times:  # hold the last counts to the end of the log
        times.append(float(ordered[-1]["time"]) - start)
        counts.append(current)
    held = np.array(counts, dtype=np.int64).reshape(-1, 2)
    return DeviceSeries(start=start, times=np.array(times), train=held[:, 0], infer=held[:, 1])


def incidents(events: list[dict[str, Any]], start: float) -> list[tuple[float, str, str]]:
    """(seconds after start, kind, label) of every event the timeline marks; labelled with a rank if any."""
    marks = []
    for event in events:
        if event.get("kind") in INCIDENT_STYLES:
            label = f"rank {event['rank']}" if "rank" in event else ""
            marks.append((float(event["time"]) - start, event["kind"], label))
    return sorted(marks)


def plot_timeline(events: list[dict[str, Any]], out: str | Path) -> Path:
    """Stacked steps of devices held by training and lent to inference; incidents as vertical lines."""
    plt = _pyplot()
    series = device_series(events)
    fig, ax = plt.subplots(figsize=(10.0, 4.0))
    if len(series.times):
        ax.fill_between(series.times, 0, series.train, step="post", color="tab:blue", alpha=0.7, label="training")
        ax.fill_between(series.times, series.train, series.train + series.infer, step="post", color="tab:orange",
                        alpha=0.7, label="inference")
        top = float((series.train + series.infer).max())
    else:
        top = 1.0
        ax.text(0.5, 0.5, "no device counts in this log", transform=ax.transAxes, ha="center", color="grey")
    seen: set[str] = set()
    for when, kind, label in incidents(events, series.start):
        color, style = INCIDENT_STYLES[kind]
        ax.axvline(when, color=color, ls=style, lw=1.2, label=None if kind in seen else kind)
        if label:
            ax.text(when, top * 1.02, label, rotation=90, fontsize=6, color=color, ha="right", va="bottom")
        seen.add(kind)
    ax.set_ylim(0, max(top * 1.25, 1.0))
    ax.set_xlabel("seconds since the first event")
    ax.set_ylabel("devices")
    ax.set_title(f"devices held by training and inference ({len(events)} events)", fontsize=10)
    ax.legend(loc="upper right", fontsize=7, ncol=2)
    return _save(fig, plt, out)


def _save(fig, plt, out: str | Path) -> Path:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
