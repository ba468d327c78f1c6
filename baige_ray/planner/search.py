"""Branch-and-bound search over DP x TP x PP x EP x ZeRO x micro-batch x recomputation x mapping.

Layouts (tp, pp, dp, mapping) are enumerated as plain integers, never as devices:
TP divides the heads (and KV heads) and fits one island, PP divides the layers
(any PP up to the layer count when chips differ, with uneven stages), DP divides
the global batch. Each layout gets two bounds before anything touches the graph:
  * time: the step cannot beat the model's FLOPs at `max_efficiency` of the peak of
    the devices it uses (no communication, no bubble, no recomputation);
  * memory: per device at least the average model state under the most sharding
    the layout allows (activations left out).
Layouts run in order of their time bound; the search stops when the bound exceeds
the k-th best distinct (tp, pp, dp, ep) found, which keeps the optimum exact (every
skipped layout provably loses). The rest of a layout (ep x ZeRO x micro-batch x
recompute, a few hundred rows) is priced as numpy arrays in one call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from baige_ray.planner.cost import all_reduce, best_device_rate, device_rates
from baige_ray.planner.evaluate import (
    Layout,
    LayoutContext,
    Rows,
    context_parallel_choices,
    evaluate,
    row_grid,
    split_layers,
)
from baige_ray.planner.links import GroupLink, LinkTables
from baige_ray.planner.mapping import MAPPINGS, layout_links, rank_positions, slot_order, stage_devices
from baige_ray.planner.memory import optimizer_bytes_per_param
from baige_ray.planner.model_spec import ModelSpec
from baige_ray.planner.options import PlanOptions
from baige_ray.topology.graph import ResourceGraph


@dataclass(kw_only=True, frozen=True)
class Candidate:
    """One fully specified configuration and its predicted cost."""

    layout: Layout
    ep: int
    zero: int
    micro_batch: int
    recompute: int
    step_s: float
    memory_ratio: float
    cp: int = 1  # context-parallel ranks per sequence, out of the layout's dp
    ulysses: bool = False  # the CP kind: Ulysses' all-to-all, else the ring's all-gather

    @property
    def degrees(self) -> tuple[int, ...]:
        return (self.layout.tp, self.layout.pp, self.layout.dp, self.ep, self.cp)

    @property
    def cp_kind(self) -> str:
        return "ulysses" if self.ulysses else "ring"

    @property
    def order_key(self) -> tuple:
        """Ties on time go to fewer devices, then smaller degrees: deterministic in every search."""
        return (self.step_s, self.layout.num_devices, *self.degrees, self.ulysses, self.zero, self.micro_batch,
                self.recompute, MAPPINGS.index(self.layout.mapping))


class Hardware:
    """The graph seen by the planner: link tables and the slot list per (tp, major), built once."""

    def __init__(self, graph: ResourceGraph, options: PlanOptions):
        self.graph = graph
        self.options = options
        self.tables = LinkTables(graph, options.constants.calibration)
        self.tables.memory_bytes = self.tables.memory_bytes * options.usable_memory_fraction
        self._slots: dict[tuple[int, str], np.ndarray] = {}
        self.max_island = int(np.unique(graph.devices.island, return_counts=True)[1].max()) if len(graph.devices) else 0
        self.mixed_chips = len(np.unique(self.tables.peak_flops)) > 1
        self.fastest_island_bandwidth = float(self.tables.island_bw.max()) if len(graph.devices) else 1.0

    def slots(self, tp: int, major: str) -> np.ndarray:
        key = (tp, major)
        if key not in self._slots:
            self._slots[key] = slot_order(self.graph, tp, self.tables.peak_flops, major)
        return self._slots[key]

    def positions(self, layout: Layout) -> np.ndarray:
        major = layout.mapping.split("/")[1]
        return rank_positions(self.slots(layout.tp, major), tp=layout.tp, dp=layout.dp, pp=layout.pp,
                              mapping=layout.mapping)


def layout_context(model: ModelSpec, hardware: Hardware, layout: Layout, links: dict[str, GroupLink], *,
                   positions: np.ndarray | None = None) -> LayoutContext | None:
    """Stage chips, layer split and memory of a layout; None when its stages cannot split the layers."""
    positions = hardware.positions(layout) if positions is None else positions
    peak, memory = stage_devices(hardware.tables, positions, pp=layout.pp)
    layers = split_layers(model.num_layers, *_layer_seconds(model, hardware.options, layout, peak, links))
    if layers is None:
        return None
    return LayoutContext(layout=layout, stage_layers=layers, stage_peak=peak, stage_memory=memory,
                         total_peak=float(hardware.tables.peak_flops[positions].sum()), links=links)


def _layer_seconds(model: ModelSpec, options: PlanOptions, layout: Layout, peak: np.ndarray,
                   links: dict[str, GroupLink]) -> tuple[np.ndarray, np.ndarray]:
    """Per stage, seconds per layer and for the LM head, for one sequence without recomputation: the
    balance of compute (which scales with chip speed) and TP all-reduces (which do not)."""
    layer_rate, head_rate = device_rates(model, options.constants, [1], layout.tp, peak)
    activation = model.seq_len * model.hidden * model.dtype_bytes
    layer = 3 * model.seq_len * model.layer_flops_per_token / (layout.tp * layer_rate[0])
    calibration = options.constants.calibration
    if calibration is None or not calibration.tensor_parallel_included(model, layout.tp, peak, links["tp"].tier):
        layer = layer + 4 * float(all_reduce(layout.tp, activation, links["tp"]))
    extra = np.zeros(layout.pp)
    extra[-1] = 3 * model.seq_len * model.logits_flops_per_token / (layout.tp * head_rate[0, -1])
    return layer, extra


def expert_sizes(model: ModelSpec, dp: int) -> tuple[int, ...]:
    experts = max(model.num_experts, 1)
    return tuple(e for e in range(1, experts + 1) if experts % e == 0 and dp % e == 0)


def candidates_of(model: ModelSpec, options: PlanOptions, context: LayoutContext,
                  rows: Rows) -> tuple[list[Candidate], Candidate | None]:
    """The best memory-feasible row per expert and context-parallel degree of a layout, and its least-infeasible row."""
    evaluation = evaluate(model, options.constants, context, rows)
    ratio = evaluation.memory_ratio
    # Same tie-break as Candidate.order_key, vectorized: time, then ep, cp, kind, zero, micro-batch, recompute.
    order = np.lexsort((rows.recompute, rows.micro_batch, rows.zero, rows.ulysses, rows.cp, rows.ep,
                        evaluation.step_s))
    order = order[ratio[order] <= 1.0]
    _, first = np.unique(np.stack([rows.ep[order], rows.cp[order]], axis=1), axis=0, return_index=True)
    feasible = [_candidate(context, rows, evaluation.step_s, ratio, int(order[i])) for i in first]
    tightest = _candidate(context, rows, evaluation.step_s, ratio, int(np.argmin(ratio))) if len(rows) else None
    return feasible, tightest


def _candidate(context: LayoutContext, rows: Rows, step_s: np.ndarray, ratio: np.ndarray, i: int) -> Candidate:
    return Candidate(layout=context.layout, ep=int(rows.ep[i]), zero=int(rows.zero[i]),
                     micro_batch=int(rows.micro_batch[i]), recompute=int(rows.recompute[i]),
                     step_s=float(step_s[i]), memory_ratio=float(ratio[i]), cp=int(rows.cp[i]),
                     ulysses=bool(rows.ulysses[i]))


# ---- enumeration and bounds ------------------------------------------------------------------


def tensor_degrees(model: ModelSpec, hardware: Hardware) -> list[int]:
    """TP degrees dividing the heads inside one island; with a calibration, only those it measured."""
    degrees = [t for t in range(1, hardware.max_island + 1) if model.num_heads % t == 0 and model.kv_heads % t == 0]
    calibration = hardware.options.constants.calibration
    if calibration is None:
        return degrees
    return calibration.measured_tps(model, np.unique(hardware.tables.peak_flops), degrees)


def pipeline_degrees(model: ModelSpec, hardware: Hardware, num_slots: int, max_pp: int | None = None) -> list[int]:
    top = min(model.num_layers, num_slots, max_pp or model.num_layers)
    return [p for p in range(1, top + 1) if hardware.mixed_chips or model.num_layers % p == 0]


def enumerate_layouts(model: ModelSpec, options: PlanOptions, hardware: Hardware) -> list[Layout]:
    layouts = []
    batch_divisors = [d for d in range(1, model.global_batch + 1) if model.global_batch % d == 0]
    for tp in tensor_degrees(model, hardware):
        for major in ("node", "rail"):
            mappings = [m for m in options.mappings if m.endswith("/" + major)]
            slots = hardware.slots(tp, major)
            if major == "rail" and _rail_major_is_node_major(hardware, tp):
                continue
            for pp in pipeline_degrees(model, hardware, len(slots), options.max_pp):
                for dp in data_parallel_degrees(model, batch_divisors, pp, len(slots) // pp):
                    layouts.extend(Layout(tp=tp, pp=pp, dp=dp, mapping=m) for m in mappings)
    return layouts


def data_parallel_degrees(model: ModelSpec, batch_divisors: list[int], pp: int, most: int) -> list[int]:
    """Data-parallel ranks up to `most`: divisors of the global batch, and, where context parallelism may
    run (ModelSpec.context_parallel, no pipeline), such a divisor times a CP degree in powers of two that
    the sequence splits into (dp / cp replicas then split the batch)."""
    factors = [1]
    if model.context_parallel and pp == 1:
        factors += [2**k for k in range(1, most.bit_length()) if model.seq_len % 2 ** (k + 1) == 0]
    return sorted({d * f for d in batch_divisors for f in factors if d * f <= most})


def _rail_major_is_node_major(hardware: Hardware, tp: int) -> bool:
    """With one slot per node both listings coincide; searching it twice would only tie."""
    return np.array_equal(hardware.slots(tp, "node"), hardware.slots(tp, "rail"))


def time_lower_bound(model: ModelSpec, options: PlanOptions, hardware: Hardware, layout: Layout) -> float:
    """No row of the layout can beat this: compute at the best efficiency any of its micro-batch sizes
    reaches, plus tensor-parallel all-reduces at the fastest island bandwidth, plus (equal chips) the
    1F1B bubble at the most micro-batches (b = 1): pipeline >= (m + p - 1) / m * (compute + TP), over
    the measured host sharing S where devices share cores (the critical path sped up by S)."""
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    major = layout.mapping.split("/")[1]
    used = hardware.slots(tp, major)[: dp * pp]
    # sequences' worth of tokens a rank computes per micro-batch at most (a fraction under context parallelism)
    largest_batch = min(model.global_batch // dp, options.max_micro_batch) or model.global_batch / dp
    peaks, counts = np.unique(hardware.tables.peak_flops[used], return_counts=True)
    rate = sum(count * best_device_rate(model, options.constants, tp, float(peak), largest_batch)
               for peak, count in zip(peaks, counts))
    compute = model.model_flops_per_step() / rate
    tensor = 0.0
    if tp > 1 and options.constants.calibration is None:  # calibrated curves may hold the TP traffic
        tokens = model.global_batch // dp * model.seq_len
        volume = 4 * 2 * (tp - 1) / tp * tokens * model.hidden * model.dtype_bytes
        tensor = model.num_layers / pp * volume / hardware.fastest_island_bandwidth
    if hardware.mixed_chips:
        return max(compute, tensor)
    most = max(1, model.global_batch // dp)
    bubble = (most + pp - 1) / most
    sharing = options.constants.host_sharing
    # Where devices share cores a short pipeline runs faster than its compute at full load (cost.pipeline_seconds),
    # never faster than its critical path with the full sharing.
    return (compute + tensor) * (bubble / sharing if sharing > 1.0 else bubble)


def memory_lower_bound(model: ModelSpec, options: PlanOptions, hardware: Hardware, layout: Layout) -> float:
    """Needed / usable for the most-sharded row, averaged over stages (the worst stage needs more)."""
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    ep = max(expert_sizes(model, dp))
    zero = max(z for z in options.zero_stages if z <= 1 or pp == 1)
    dense = model.num_layers * model.dense_layer_params + model.embedding_params + model.output_params
    expert = model.num_layers * model.expert_layer_params / ep
    per_device = (dense + expert) / (tp * pp)
    replicated = (dense / (tp * pp * dp) if zero >= 3 else per_device) * model.dtype_bytes
    replicated += (dense / (tp * pp * dp) if zero >= 2 else per_device) * model.dtype_bytes
    states = replicated + optimizer_bytes_per_param(model) * (dense / (tp * pp * dp) if zero >= 1 else per_device)
    major = layout.mapping.split("/")[1]
    used = hardware.slots(tp, major)[: dp * pp]
    return states / float(hardware.tables.memory_bytes[used].max())


# ---- the search ---------------------------------------------------------------------------------


@dataclass(kw_only=True)
class SearchResult:
    ranked: list[Candidate]  # best first: the winner, then the best of each other distinct (tp, pp, dp, ep)
    tightest: Candidate | None  # least memory-infeasible row seen, for the infeasibility error
    layouts_total: int
    layouts_evaluated: int


class _TopDistinct:
    """Best candidate per distinct (tp, pp, dp, ep), and the k-th best time as the pruning bar."""

    def __init__(self, keep: int):
        self.keep = keep
        self.best: dict[tuple, Candidate] = {}

    def offer(self, candidate: Candidate) -> None:
        current = self.best.get(candidate.degrees)
        if current is None or candidate.order_key < current.order_key:
            self.best[candidate.degrees] = candidate

    def bar(self) -> float:
        if len(self.best) < self.keep:
            return float("inf")
        return sorted(c.step_s for c in self.best.values())[self.keep - 1]

    def ranked(self) -> list[Candidate]:
        return sorted(self.best.values(), key=lambda c: c.order_key)[: self.keep]


def search(model: ModelSpec, options: PlanOptions, hardware: Hardware, *,
           progress: Callable[[str, int, int], None] | None = None) -> SearchResult:
    """Layouts in order of their lower bound on step time, priced until the bound passes the k-th best.
    `progress("layouts", considered, total)` follows the walk."""
    layouts = enumerate_layouts(model, options, hardware)
    bounds = sorted((time_lower_bound(model, options, hardware, layout), index) for index, layout in enumerate(layouts))
    top = _TopDistinct(options.top_k + 1)
    evaluated = 0
    for considered, (bound, index) in enumerate(bounds):
        if progress is not None:
            progress("layouts", considered, len(bounds))
        if bound > top.bar():
            break
        layout = layouts[index]
        if memory_lower_bound(model, options, hardware, layout) > 1.0:
            continue
        feasible, _ = _price(model, options, hardware, layout)
        evaluated += 1
        for candidate in feasible:
            top.offer(candidate)
    ranked = top.ranked()
    tightest = None if ranked else _least_infeasible(model, options, hardware, layouts)
    return SearchResult(ranked=ranked, tightest=tightest, layouts_total=len(layouts), layouts_evaluated=evaluated)


def _least_infeasible(model: ModelSpec, options: PlanOptions, hardware: Hardware, layouts: list[Layout],
                      limit: int = 64) -> Candidate | None:
    """For the error message: price the layouts closest to fitting and keep the tightest row."""
    closest = sorted(layouts, key=lambda layout: memory_lower_bound(model, options, hardware, layout))[:limit]
    tightest = None
    for layout in closest:
        _, least = _price(model, options, hardware, layout)
        if least is not None and (tightest is None or least.memory_ratio < tightest.memory_ratio):
            tightest = least
    return tightest


def _price(model: ModelSpec, options: PlanOptions, hardware: Hardware,
           layout: Layout) -> tuple[list[Candidate], Candidate | None]:
    context = _context(model, hardware, layout)
    if context is None:
        return [], None
    rows = row_grid(model, dp=layout.dp, pp=layout.pp, zero_stages=options.zero_stages,
                    recomputes=options.recompute_codes, max_micro_batch=options.max_micro_batch,
                    expert_parallel_zero_stages=options.expert_parallel_zero_stages, tp=layout.tp)
    return candidates_of(model, options, context, rows)


def _context(model: ModelSpec, hardware: Hardware, layout: Layout) -> LayoutContext | None:
    positions = hardware.positions(layout)
    cps = tuple(sorted({cp for cp, _ in context_parallel_choices(model, dp=layout.dp, pp=layout.pp, tp=layout.tp)}
                       - {1}))
    links = layout_links(hardware.tables, positions, tp=layout.tp, dp=layout.dp, pp=layout.pp,
                         eps=expert_sizes(model, layout.dp) if model.is_moe else (), cps=cps)
    return layout_context(model, hardware, layout, links)
