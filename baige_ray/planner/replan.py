"""Re-plan after devices were lost or added, moving as little state as possible.

Two answers are priced on the new graph: a fresh plan, and (when the fresh plan keeps the
old degrees) a *repair* that leaves every intact tensor-parallel group where it is and
gives each broken one a whole free slot of one island. The repair wins unless it is more
than `PlanOptions.replan_tolerance` slower; then no surviving rank moves and only the
replacement ranks load state, from a data-parallel peer holding the same (stage, TP) shard
of the weights. Under ZeRO the lost rank's optimizer shard exists nowhere else: it comes
from the flash-checkpoint replica, which `state_sources` does not name.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from baige_ray.planner.evaluate import Layout
from baige_ray.planner.mapping import rank_groups
from baige_ray.planner.memory import RECOMPUTE
from baige_ray.planner.plan import PlacementPlan, build_plan, price_candidate
from baige_ray.planner.search import Candidate, Hardware
from baige_ray.topology.graph import ResourceGraph


@dataclass(kw_only=True, frozen=True, eq=False)
class ReplanResult:
    plan: PlacementPlan
    repaired: bool  # True: old layout kept, only broken TP groups moved
    reshard: bool  # True: degrees or layer split changed, every rank reloads resharded state
    ranks_in_place: int  # ranks whose device and model shard are unchanged
    state_sources: dict[int, int | None]  # moved rank -> device id of a peer with its shard (None: from checkpoint)


def replan(old: PlacementPlan, graph: ResourceGraph) -> ReplanResult:
    from baige_ray.planner.plan import plan as fresh_plan

    fresh = fresh_plan(old.model, graph, old.options)
    hardware = Hardware(graph, old.options)
    repaired_positions = _repair(old, hardware) if _same_shape(old, fresh) else None
    if repaired_positions is not None:
        candidate = _candidate_of(fresh)
        _, evaluation = price_candidate(old.model, old.options, hardware, candidate, repaired_positions)
        if evaluation.feasible[0] and evaluation.step_s[0] <= fresh.step_time_s * (1 + old.options.replan_tolerance):
            kept = build_plan(old.model, old.options, hardware, candidate, [], dict(fresh.search_stats),
                              positions=repaired_positions)
            return _result(old, kept, repaired=True)
    return _result(old, fresh, repaired=False)


def _same_shape(old: PlacementPlan, new: PlacementPlan) -> bool:
    return (old.tp, old.pp, old.dp, old.ep, old.cp) == (new.tp, new.pp, new.dp, new.ep, new.cp)


def _candidate_of(plan: PlacementPlan) -> Candidate:
    return Candidate(layout=Layout(tp=plan.tp, pp=plan.pp, dp=plan.dp, mapping=plan.mapping), ep=plan.ep,
                     zero=plan.zero_stage, micro_batch=plan.micro_batch_size,
                     recompute=RECOMPUTE.index(plan.recompute), step_s=plan.step_time_s, memory_ratio=0.0,
                     cp=plan.cp, ulysses=plan.cp_kind == "ulysses")


def _repair(old: PlacementPlan, hardware: Hardware) -> np.ndarray | None:
    """Old rank positions with each broken TP group moved to a free slot; None if slots run out."""
    graph = hardware.graph
    present = np.isin(old.rank_to_device, graph.device_ids)
    positions = np.full(old.num_ranks, -1, dtype=np.int64)
    positions[present] = graph.positions(old.rank_to_device[present])
    tp_groups = rank_groups("tp", old.tp, old.dp, old.pp)
    broken = tp_groups[~present[tp_groups].all(axis=1)]
    used = set(positions[present].tolist())
    free_slots = [slot for slot in hardware.slots(old.tp, "node") if not used.intersection(slot.tolist())]
    if len(free_slots) < len(broken):
        return None
    for group, slot in zip(broken, free_slots):
        positions[group] = slot
    return positions


def _result(old: PlacementPlan, new: PlacementPlan, *, repaired: bool) -> ReplanResult:
    same_split = old.stage_layers == new.stage_layers and old.tp == new.tp
    old_shard = _shards(old) if same_split else {}
    alive = set(new.rank_to_device.tolist())
    holder: dict[tuple[int, int], int] = {}
    for device, shard in old_shard.items():
        if device in alive:
            holder.setdefault(shard, device)
    sources: dict[int, int | None] = {}
    in_place = 0
    for rank, device in enumerate(new.rank_to_device.tolist()):
        shard = _shard_of(new, rank)
        if old_shard.get(device) == shard:
            in_place += 1
        else:
            sources[rank] = holder.get(shard)
    return ReplanResult(plan=new, repaired=repaired, reshard=not same_split, ranks_in_place=in_place,
                        state_sources=sources)


def _shard_of(plan: PlacementPlan, rank: int) -> tuple[int, int]:
    return plan.stage_of_rank(rank), rank % plan.tp


def _shards(plan: PlacementPlan) -> dict[int, tuple[int, int]]:
    return {device: _shard_of(plan, rank) for rank, device in enumerate(plan.rank_to_device.tolist())}
