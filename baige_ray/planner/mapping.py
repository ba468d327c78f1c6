"""Rank -> device mapping: tensor-parallel slots inside one island, slots stacked so DP/PP peers share a rail.

Ranks follow Megatron-LM's convention, tensor-parallel fastest:
rank = (stage * dp + replica) * tp + tp_index. A *slot* is `tp` devices of one
NVLink island (consecutive local indices), so every TP group is one slot and
never leaves the island. Slot column j of node A and of node B hold devices with
the same local indices, which on a rail-optimized fabric are served by the same
rail, so a data- or pipeline-parallel group that walks one column across nodes
keeps its cross-node traffic on one rail and leaf (Narayanan et al. 2021,
sec. 3.3: TP within a node, DP/PP across nodes).

Four mappings are searched: the slot list is node-major (a node's slots next to
each other, so the dimension after TP fills the node over NVLink first) or
rail-major (slot column j of every node next to each other, so that dimension
crosses nodes on one rail); and the dimension after TP is data parallel
("tp-dp-pp", Megatron's default: the larger DP volume gets the nearer links) or
pipeline parallel ("tp-pp-dp": pipeline neighbours closest).
Slots of faster chips come first, so a pipeline over mixed chips gets whole
stages of one chip type and a plan that uses fewer devices than exist uses the
fastest ones.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from baige_ray.planner.links import GroupLink, LinkTables, expert_link_key, group_link, neighbour_link
from baige_ray.topology.graph import ResourceGraph

DIM_ORDERS = ("tp-dp-pp", "tp-pp-dp")
SLOT_MAJORS = ("node", "rail")
MAPPINGS = tuple(f"{order}/{major}" for major in SLOT_MAJORS for order in DIM_ORDERS)
DIMENSIONS = ("tp", "dp", "pp", "ep")


def slot_order(graph: ResourceGraph, tp: int, peak_flops: np.ndarray, major: str) -> np.ndarray:
    """Graph row positions of every complete `tp`-slot, shape (num_slots, tp), fastest chips first,
    then node-major or rail-major (`major`).

    Devices left over in an island that cannot form a whole slot are not used.
    """
    island = graph.devices.island
    rows = np.lexsort((np.arange(len(island)), island))
    sorted_island = island[rows]
    starts = np.flatnonzero(np.r_[True, sorted_island[1:] != sorted_island[:-1]])
    sizes = np.diff(np.r_[starts, len(rows)])
    index_in_island = np.arange(len(rows)) - np.repeat(starts, sizes)
    usable = index_in_island < np.repeat(sizes // tp * tp, sizes)
    slots = rows[usable].reshape(-1, tp)
    index = np.arange(len(slots))
    if major == "node":
        return slots[np.lexsort((index, -peak_flops[slots[:, 0]]))]
    node = graph.devices.node[slots[:, 0]]
    node_start = np.flatnonzero(np.r_[True, node[1:] != node[:-1]])
    column = index - np.repeat(node_start, np.diff(np.r_[node_start, len(slots)]))
    return slots[np.lexsort((index, column, -peak_flops[slots[:, 0]]))]


def rank_positions(slots: np.ndarray, *, tp: int, dp: int, pp: int, mapping: str) -> np.ndarray:
    """Graph row position of every rank for a layout using the first dp * pp slots."""
    used = slots[: dp * pp]
    if mapping.startswith("tp-pp-dp"):
        used = used.reshape(dp, pp, tp).transpose(1, 0, 2)
    return used.reshape(-1)


@lru_cache(maxsize=4096)
def rank_groups(dim: str, tp: int, dp: int, pp: int, ep: int = 1, stride: int = 1) -> np.ndarray:
    """Ranks of every group of one dimension, shape (num_groups, group_size). Expert groups take every
    `stride`-th replica of a block of ep x stride: with context parallelism (stride = cp) the engines' mesh
    keeps a replica's CP ranks next to each other, so the ranks holding the other experts are cp apart."""
    ranks = np.arange(tp * dp * pp)
    if dim == "tp":
        return ranks.reshape(-1, tp)
    if dim == "dp":
        return ranks.reshape(pp, dp, tp).transpose(0, 2, 1).reshape(-1, dp)
    if dim == "pp":
        return ranks.reshape(pp, dp * tp).T.copy()
    if dim == "ep":  # expert parallelism splits each data-parallel group into blocks of `ep` replicas
        blocks = ranks.reshape(pp, dp // (ep * stride), ep, stride, tp)
        return blocks.transpose(0, 1, 3, 4, 2).reshape(-1, ep)
    raise ValueError(f"dim={dim!r} is invalid: expected one of {', '.join(DIMENSIONS)}")


def layout_links(tables: LinkTables, positions: np.ndarray, *, tp: int, dp: int, pp: int,
                 eps: tuple[int, ...], cps: tuple[int, ...] = ()) -> dict[str, GroupLink]:
    """Worst link of each dimension's groups; expert groups keyed "ep{n}" for every size tried,
    context-parallel groups "cp{n}" (blocks of n consecutive data-parallel ranks, as expert groups are), and
    the expert groups beside each CP degree, `expert_link_key(n, cp)` (their ranks cp apart)."""
    links = {
        "tp": group_link(tables, positions[rank_groups("tp", tp, dp, pp)]),
        "dp": group_link(tables, positions[rank_groups("dp", tp, dp, pp)]),
        "pp": neighbour_link(tables, positions[rank_groups("pp", tp, dp, pp)]),
    }
    for ep in eps:
        links[f"ep{ep}"] = group_link(tables, positions[rank_groups("ep", tp, dp, pp, ep)])
    for cp in cps:
        links[f"cp{cp}"] = group_link(tables, positions[rank_groups("ep", tp, dp, pp, cp)])
        for ep in (ep for ep in eps if ep > 1 and dp % (ep * cp) == 0):
            links[expert_link_key(ep, cp)] = group_link(tables, positions[rank_groups("ep", tp, dp, pp, ep, cp)])
    return links


def stage_devices(tables: LinkTables, positions: np.ndarray, *, pp: int) -> tuple[np.ndarray, np.ndarray]:
    """Per stage, the slowest chip's peak FLOP/s and the smallest device memory (bytes)."""
    per_stage = positions.reshape(pp, -1)
    return tables.peak_flops[per_stage].min(axis=1), tables.memory_bytes[per_stage].min(axis=1)
