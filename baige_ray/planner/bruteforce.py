"""Exhaustive search under the same cost model, to check the planner's pruned search against.

Independent of the planner where the planner takes shortcuts: every integer degree
in range is tried and filtered by the validity rules (no divisor enumeration), no
bounds prune anything, and each group's link comes from `groups.slowest_link`
/ `tier_between` over the actual rank -> device groups (not the vectorized link
tables). Only `evaluate` (the cost model itself) and the rank mapping are shared.
Exponential in nothing but slow in everything: meant for grids of up to ~64 devices.
"""

from __future__ import annotations

import itertools

import numpy as np

from baige_ray.planner.evaluate import Layout, Rows, evaluate
from baige_ray.planner.links import NO_LINK, GroupLink, with_measured
from baige_ray.planner.mapping import rank_groups
from baige_ray.planner.model_spec import ModelSpec
from baige_ray.planner.options import PlanOptions
from baige_ray.planner.search import Candidate, Hardware, layout_context
from baige_ray.topology.graph import ResourceGraph
from baige_ray.topology.groups import slowest_link


def brute_force(model: ModelSpec, graph: ResourceGraph, options: PlanOptions | None = None) -> Candidate | None:
    """The best memory-feasible candidate over the whole space, same tie-break as the planner."""
    options = options or PlanOptions()
    hardware = Hardware(graph, options)
    best: Candidate | None = None
    for layout in _all_layouts(model, options, hardware):
        for candidate in _price_every_row(model, options, hardware, layout):
            if best is None or candidate.order_key < best.order_key:
                best = candidate
    return best


def _all_layouts(model: ModelSpec, options: PlanOptions, hardware: Hardware):
    n = hardware.graph.num_devices
    calibration = options.constants.calibration
    measured = None if calibration is None else set(
        calibration.measured_tps(model, np.unique(hardware.tables.peak_flops), range(1, n + 1)))
    for tp, pp, dp, mapping in itertools.product(range(1, n + 1), range(1, n + 1), range(1, n + 1), options.mappings):
        if tp * pp * dp > n or model.num_heads % tp or model.kv_heads % tp or tp > hardware.max_island:
            continue
        if measured is not None and tp not in measured:
            continue
        if pp > model.num_layers or model.global_batch % dp:
            continue
        if dp * pp > len(hardware.slots(tp, mapping.split("/")[1])):
            continue
        yield Layout(tp=tp, pp=pp, dp=dp, mapping=mapping)


def _price_every_row(model: ModelSpec, options: PlanOptions, hardware: Hardware, layout: Layout):
    positions = hardware.positions(layout)
    experts = max(model.num_experts, 1)
    eps = [e for e in range(1, experts + 1) if experts % e == 0 and layout.dp % e == 0]
    links = {dim: with_measured(hardware.tables, link)
             for dim, link in _exact_links(hardware.graph, positions, layout, eps if model.is_moe else []).items()}
    context = layout_context(model, hardware, layout, links, positions=positions)
    if context is None:
        return
    per_replica = model.global_batch // layout.dp
    for ep, zero, b, rc in itertools.product(eps, options.zero_stages, range(1, per_replica + 1),
                                             options.recompute_codes):
        if per_replica % b or b > options.max_micro_batch or (zero >= 2 and layout.pp > 1):
            continue
        if ep > 1 and zero not in options.expert_parallel_zero_stages:
            continue
        rows = Rows(ep=np.array([ep]), zero=np.array([zero]), micro_batch=np.array([b]), recompute=np.array([rc]))
        evaluation = evaluate(model, options.constants, context, rows)
        if evaluation.memory_ratio[0] <= 1.0:
            yield Candidate(layout=layout, ep=ep, zero=zero, micro_batch=b, recompute=rc,
                            step_s=float(evaluation.step_s[0]), memory_ratio=float(evaluation.memory_ratio[0]))


def _exact_links(graph: ResourceGraph, positions: np.ndarray, layout: Layout, eps: list[int]) -> dict[str, GroupLink]:
    ids = graph.devices.device_id[positions]
    tp, dp, pp = layout.tp, layout.dp, layout.pp
    links = {"tp": _worst_group(graph, ids[rank_groups("tp", tp, dp, pp)]),
             "dp": _worst_group(graph, ids[rank_groups("dp", tp, dp, pp)]),
             "pp": _worst_neighbours(graph, ids[rank_groups("pp", tp, dp, pp)])}
    for ep in eps:
        links[f"ep{ep}"] = _worst_group(graph, ids[rank_groups("ep", tp, dp, pp, ep)])
    return links


def _worst_group(graph: ResourceGraph, groups: np.ndarray) -> GroupLink:
    summaries = [slowest_link(graph, group) for group in groups]
    summaries = [s for s in summaries if s is not None]
    if not summaries:
        return NO_LINK
    return GroupLink(tier=int(max(s.tier for s in summaries)),
                     bandwidth=min(s.bandwidth_gb_per_s for s in summaries) * 1e9,
                     latency=max(s.latency_us for s in summaries) * 1e-6)


def _worst_neighbours(graph: ResourceGraph, chains: np.ndarray) -> GroupLink:
    if chains.shape[1] < 2:
        return NO_LINK
    a, b = chains[:, :-1].ravel(), chains[:, 1:].ravel()
    return GroupLink(tier=int(np.max(graph.tier_between(a, b))),
                     bandwidth=float(np.min(graph.bandwidth_between(a, b))) * 1e9,
                     latency=float(np.max(graph.latency_between(a, b))) * 1e-6)

