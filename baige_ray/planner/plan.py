"""`plan(model, graph)` -> `PlacementPlan`: the chosen layout, every rank's device, groups, predictions."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from baige_ray.api.errors import InfeasiblePlanError
from baige_ray.planner.evaluate import Layout, LayoutContext, Rows, evaluate
from baige_ray.planner.explain import breakdown, exposure, why_lost
from baige_ray.planner.links import GroupLink
from baige_ray.planner.mapping import DIMENSIONS, layout_links, rank_groups
from baige_ray.planner.memory import RECOMPUTE
from baige_ray.planner.model_spec import ModelSpec
from baige_ray.planner.options import PlanOptions
from baige_ray.planner.search import Candidate, Hardware, expert_sizes, layout_context, search
from baige_ray.topology.graph import ResourceGraph


@dataclass(kw_only=True, frozen=True)
class Alternative:
    """A runner-up layout (best row of its distinct tp/pp/dp/ep) and why it lost to the plan."""

    tp: int
    pp: int
    dp: int
    ep: int
    zero_stage: int
    micro_batch_size: int
    recompute: str
    mapping: str
    step_time_s: float
    why_lost: str
    cp: int = 1
    cp_kind: str = "ring"

    def describe(self) -> str:
        cp = f" cp={self.cp} ({self.cp_kind})" if self.cp > 1 else ""
        return (f"tp={self.tp} pp={self.pp} dp={self.dp}{cp} ep={self.ep} zero={self.zero_stage} "
                f"b={self.micro_batch_size} recompute={self.recompute} {self.mapping}")


@dataclass(kw_only=True, frozen=True, eq=False)
class PlacementPlan:
    """Ranks are Megatron-ordered: rank = (stage * dp + replica) * tp + tp_index."""

    model: ModelSpec
    options: PlanOptions
    cluster: str
    tp: int
    pp: int
    dp: int
    ep: int
    zero_stage: int
    micro_batch_size: int
    num_micro_batches: int
    recompute: str
    mapping: str
    rank_to_device: np.ndarray  # device id (graph id) of every rank
    rank_to_node: np.ndarray  # node id of every rank
    stage_layers: tuple[int, ...]
    stage_chips: tuple[str, ...]
    stage_time_s: tuple[float, ...]  # per micro-batch, forward + backward + on-path communication
    step_time_s: float
    breakdown_s: dict[str, float]
    exposure_s: dict[str, dict[str, float]]  # per communication term: {"total_s", "exposed_s"}
    memory_per_device_gb: float  # worst stage
    memory_by_stage_gb: tuple[float, ...]
    usable_memory_by_stage_gb: tuple[float, ...]
    mfu: float
    links: dict[str, GroupLink]  # worst link each dimension's groups span
    alternatives: tuple[Alternative, ...] = ()
    search_stats: dict[str, Any] = field(default_factory=dict)
    # Context parallelism: blocks of `cp` consecutive data-parallel ranks of `dp` share each sequence (dp / cp
    # replicas), as ParallelLayout(dp=dp // cp, cp=cp) runs them; why, in words, when cp > 1.
    cp: int = 1
    cp_kind: str = "ring"
    context_parallel_reason: str = ""

    @property
    def num_ranks(self) -> int:
        return self.tp * self.pp * self.dp

    def groups(self, dim: str) -> np.ndarray:
        """Ranks of every group of `dim` ("tp", "dp", "pp" or "ep"), shape (num_groups, group_size)."""
        return rank_groups(dim, self.tp, self.dp, self.pp, self.ep)

    def device_groups(self, dim: str) -> np.ndarray:
        return self.rank_to_device[self.groups(dim)]

    def stage_of_rank(self, rank: int) -> int:
        return rank // (self.tp * self.dp)


def plan(model: ModelSpec, graph: ResourceGraph, options: PlanOptions | None = None, *,
         progress: Callable[[str, int, int], None] | None = None) -> PlacementPlan:
    """The fastest layout of `model` on `graph` under the cost model; raises InfeasiblePlanError.
    `progress(stage, done, total)` is told how the search goes (for a progress display)."""
    options = options or PlanOptions()
    ignored = _calibration_without(model, graph, options)
    if ignored:
        options = dataclasses.replace(options, calibration=None)
    start = time.perf_counter()
    if progress is not None:
        progress("links between the devices", 0, 1)
    hardware = Hardware(graph, options)
    result = search(model, options, hardware, progress=progress)
    if not result.ranked:
        raise _infeasible(model, hardware, result.tightest)
    stats = {"layouts": result.layouts_total, "layouts_priced": result.layouts_evaluated}
    built = build_plan(model, options, hardware, result.ranked[0], result.ranked[1:], stats)
    built.search_stats["plan_s"] = time.perf_counter() - start
    if ignored:
        built.search_stats["calibration_ignored"] = ignored
    return built


def _calibration_without(model: ModelSpec, graph: ResourceGraph, options: PlanOptions) -> str:
    """Why the options' calibration cannot price `model` on `graph` ('' when it can): it measured
    none of the model's shapes, and its links beside nominal compute would mix two scales."""
    calibration = options.calibration
    if calibration is None:
        return ""
    peaks = np.unique(np.array([p.peak_tflops for p in graph.profiles])[graph.devices.profile] * 1e12)
    if calibration.measured_tps(model, peaks, range(1, graph.num_devices + 1)):
        return ""
    return (f"calibration {calibration.fingerprint} has no compute figures of {model.name}'s shapes; run "
            f"`baige-ray calibrate --model` with it")


def price_candidate(model: ModelSpec, options: PlanOptions, hardware: Hardware, candidate: Candidate,
                    positions: np.ndarray | None = None):
    """(context, evaluation) of one candidate; `positions` overrides the mapping's rank placement."""
    layout = candidate.layout
    positions = hardware.positions(layout) if positions is None else positions
    links = layout_links(hardware.tables, positions, tp=layout.tp, dp=layout.dp, pp=layout.pp,
                         eps=expert_sizes(model, layout.dp) if model.is_moe else (),
                         cps=(candidate.cp,) if candidate.cp > 1 else ())
    context = layout_context(model, hardware, layout, links, positions=positions)
    rows = Rows(ep=np.array([candidate.ep]), zero=np.array([candidate.zero]),
                micro_batch=np.array([candidate.micro_batch]), recompute=np.array([candidate.recompute]),
                cp=np.array([candidate.cp]), ulysses=np.array([candidate.ulysses]))
    return context, evaluate(model, options.constants, context, rows)


def build_plan(model: ModelSpec, options: PlanOptions, hardware: Hardware, winner: Candidate,
               runners_up: list[Candidate], stats: dict[str, Any],
               positions: np.ndarray | None = None) -> PlacementPlan:
    layout = winner.layout
    positions = hardware.positions(layout) if positions is None else positions
    context, evaluation = price_candidate(model, options, hardware, winner, positions)
    parts = breakdown(evaluation)
    step = float(evaluation.step_s[0])
    alternatives = tuple(_alternative(model, options, hardware, alt, parts, step) for alt in runners_up)
    graph = hardware.graph
    return PlacementPlan(
        model=model, options=options, cluster=graph.name, tp=layout.tp, pp=layout.pp, dp=layout.dp, ep=winner.ep,
        zero_stage=winner.zero, micro_batch_size=winner.micro_batch,
        num_micro_batches=int(evaluation.num_micro_batches[0]), recompute=RECOMPUTE[winner.recompute],
        mapping=layout.mapping, rank_to_device=graph.devices.device_id[positions].copy(),
        rank_to_node=graph.devices.node[positions].astype(np.int64),
        stage_layers=tuple(int(n) for n in context.stage_layers),
        stage_chips=_stage_chips(graph, positions, layout.pp),
        stage_time_s=tuple(float(t) for t in np.broadcast_to(evaluation.times.total, (1, layout.pp))[0]),
        step_time_s=step, breakdown_s=parts, exposure_s=exposure(evaluation),
        memory_per_device_gb=float(evaluation.memory_bytes[0].max() / 1e9),
        memory_by_stage_gb=tuple(float(b / 1e9) for b in evaluation.memory_bytes[0]),
        usable_memory_by_stage_gb=tuple(float(b / 1e9) for b in context.stage_memory),
        mfu=float(evaluation.mfu[0]), links=dict(context.links), alternatives=alternatives, search_stats=dict(stats),
        cp=winner.cp, cp_kind=winner.cp_kind,
        context_parallel_reason=_context_parallel_reason(model, options, hardware, winner, evaluation, context))


def _context_parallel_reason(model: ModelSpec, options: PlanOptions, hardware: Hardware, winner: Candidate,
                             evaluation, context) -> str:
    """Why the plan splits sequences: the same layout without CP, priced alike (its memory, or its time). Its
    ranks then hold whole sequences for as many micro-batches: as many sequences as cp x the batch."""
    if winner.cp == 1:
        return ""
    alone = dataclasses.replace(winner, cp=1, ulysses=False)
    whole = dataclasses.replace(model, global_batch=model.global_batch * winner.cp)
    _, without = price_candidate(whole, options, hardware, alone)
    worst = int(np.argmax(context.stage_memory))
    needed, usable = float(without.memory_bytes[0].max()) / 1e9, float(context.stage_memory[worst]) / 1e9
    with_cp = float(evaluation.memory_bytes[0].max()) / 1e9
    if needed > usable:
        return (f"each rank keeps 1/{winner.cp} of every sequence: {with_cp:.1f} GB a device, where the same layout "
                f"without CP needs {needed:.1f} GB of {usable:.1f} usable")
    return (f"each rank keeps 1/{winner.cp} of every sequence ({with_cp:.1f} GB a device against {needed:.1f} without "
            f"CP), which lets a larger micro-batch or less recomputation run faster")


def _alternative(model: ModelSpec, options: PlanOptions, hardware: Hardware, candidate: Candidate,
                 winner_parts: dict[str, float], winner_step: float) -> Alternative:
    _, evaluation = price_candidate(model, options, hardware, candidate)
    layout = candidate.layout
    return Alternative(tp=layout.tp, pp=layout.pp, dp=layout.dp, ep=candidate.ep, zero_stage=candidate.zero,
                       micro_batch_size=candidate.micro_batch, recompute=RECOMPUTE[candidate.recompute],
                       mapping=layout.mapping, step_time_s=candidate.step_s,
                       why_lost=why_lost(winner_parts, breakdown(evaluation), winner_step, candidate.step_s),
                       cp=candidate.cp, cp_kind=candidate.cp_kind)


def _stage_chips(graph: ResourceGraph, positions: np.ndarray, pp: int) -> tuple[str, ...]:
    profile = graph.devices.profile[positions].reshape(pp, -1)
    return tuple("+".join(sorted({graph.profiles[int(p)].chip_model for p in stage})) for stage in profile)


def _infeasible(model: ModelSpec, hardware: Hardware, tightest: Candidate | None) -> InfeasiblePlanError:
    graph = hardware.graph
    if tightest is None:
        return InfeasiblePlanError(f"{model.name} cannot be laid out on {graph.num_devices} devices of "
                                   f"{graph.name!r} (no layout divides the model and batch)", needed_gb=float("nan"),
                                   available_gb=float(hardware.tables.memory_bytes.max(initial=0) / 1e9),
                                   layout="none")
    context, evaluation = price_candidate(model, hardware.options, hardware, tightest)
    worst = int(np.argmax(evaluation.memory_bytes[0] / context.stage_memory))
    layout = tightest.layout
    cp = f" cp={tightest.cp} ({tightest.cp_kind})" if tightest.cp > 1 else ""
    text = (f"tp={layout.tp} pp={layout.pp} dp={layout.dp}{cp} ep={tightest.ep} zero={tightest.zero} "
            f"b={tightest.micro_batch} recompute={RECOMPUTE[tightest.recompute]}")
    return InfeasiblePlanError(f"{model.name} ({model.num_params / 1e9:.1f}B parameters) does not fit on "
                               f"{graph.num_devices} devices of {graph.name!r}",
                               needed_gb=float(evaluation.memory_bytes[0, worst] / 1e9),
                               available_gb=float(context.stage_memory[worst] / 1e9), layout=text)


__all__ = ["Alternative", "DIMENSIONS", "Layout", "LayoutContext", "PlacementPlan", "build_plan", "plan"]
