"""One layout (tp, pp, dp, mapping) priced for many rows of (ep, cp, ZeRO, micro-batch, recompute).

A row's `cp` context-parallel ranks come out of the layout's dp ranks (as expert groups do: blocks of
consecutive replicas): dp / cp replicas split the global batch, each sequence over cp ranks.

The planner's search and the brute-force check both call `evaluate`; they differ in
how they enumerate layouts and how they find each group's links, which is exactly
what the brute-force comparison tests.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from baige_ray.planner import context_parallel
from baige_ray.planner.cost import CostConstants, StageTimes, pipeline_seconds, stage_times
from baige_ray.planner.links import GroupLink
from baige_ray.planner.memory import activation_bytes, model_state_bytes, stage_param_counts
from baige_ray.planner.model_spec import ModelSpec
from baige_ray.planner.overlap import data_parallel_cost


@dataclass(kw_only=True, frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    mapping: str

    @property
    def num_devices(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass(kw_only=True)
class LayoutContext:
    """What the graph tells about one layout: stage chips, memory and the links of every dimension."""

    layout: Layout
    stage_layers: np.ndarray  # int, per stage
    stage_peak: np.ndarray  # FLOP/s of the slowest chip in each stage
    stage_memory: np.ndarray  # usable bytes of the smallest device in each stage
    total_peak: float  # sum of peak FLOP/s over the devices used
    links: dict[str, GroupLink]


@dataclass(kw_only=True)
class Rows:
    ep: np.ndarray
    zero: np.ndarray
    micro_batch: np.ndarray
    recompute: np.ndarray
    cp: np.ndarray | None = None  # context-parallel degree per row (None: 1 everywhere)
    ulysses: np.ndarray | None = None  # the CP kind per row: Ulysses' all-to-all, else the ring's all-gather

    def __post_init__(self) -> None:
        if self.cp is None:
            self.cp = np.ones(len(self.ep), dtype=np.int64)
        if self.ulysses is None:
            self.ulysses = np.zeros(len(self.ep), dtype=bool)

    def __len__(self) -> int:
        return len(self.ep)

    def take(self, index) -> Rows:
        return Rows(ep=self.ep[index], zero=self.zero[index], micro_batch=self.micro_batch[index],
                    recompute=self.recompute[index], cp=self.cp[index], ulysses=self.ulysses[index])


@dataclass(kw_only=True)
class Evaluation:
    step_s: np.ndarray  # (rows,)
    pipeline_s: np.ndarray
    dp_exposed_s: np.ndarray
    dp_total_s: np.ndarray  # DP / ZeRO traffic per step, hidden or not
    framework_s: np.ndarray  # optimizer update and the step's fixed cost (calibrated; 0 nominal)
    num_micro_batches: np.ndarray
    times: StageTimes  # per micro-batch, (rows, stages)
    memory_bytes: np.ndarray  # (rows, stages)
    memory_ratio: np.ndarray  # (rows,) worst stage needed / usable
    mfu: np.ndarray

    @property
    def feasible(self) -> np.ndarray:
        return self.memory_ratio <= 1.0


def evaluate(model: ModelSpec, constants: CostConstants, context: LayoutContext, rows: Rows) -> Evaluation:
    layout = context.layout
    m = model.global_batch // (layout.dp // rows.cp * rows.micro_batch)
    exchanges = context_parallel.layer_seconds(model, cp=rows.cp, ulysses=rows.ulysses, micro_batch=rows.micro_batch,
                                               tp=layout.tp, links=context.links)
    times = stage_times(model, constants, stage_layers=context.stage_layers, stage_peak=context.stage_peak,
                        tp=layout.tp, pp=layout.pp, links=context.links, ep=rows.ep, micro_batch=rows.micro_batch,
                        recompute=rows.recompute, cp=rows.cp, cp_exchanges=exchanges)
    dense, expert = stage_param_counts(model, context.stage_layers)
    data_parallel = data_parallel_cost(model, times, constants, stage_layers=context.stage_layers, stage_dense=dense,
                                       stage_expert=expert, tp=layout.tp, dp=layout.dp, link=context.links["dp"],
                                       ep=rows.ep, zero=rows.zero, num_micro_batches=m,
                                       measured_sharding=_measured_sharding(model, constants, context, rows),
                                       measured_zero_steps=_measured_zero_steps(model, constants, context, rows))
    pipeline = pipeline_seconds(times.total, m, constants.host_sharing, constants.sharing_measured_at)
    framework = framework_seconds(model, constants, context, dense, expert, ep=rows.ep, zero=rows.zero)
    step = pipeline + data_parallel.exposed + framework
    memory = (model_state_bytes(model, context.stage_layers, tp=layout.tp, dp=layout.dp, ep=rows.ep, zero=rows.zero)
              + activation_bytes(model, context.stage_layers, tp=layout.tp, pp=layout.pp,
                                 micro_batch=rows.micro_batch, recompute=rows.recompute, num_micro_batches=m,
                                 cp=rows.cp))
    ratio = (memory / context.stage_memory[None, :]).max(axis=1)
    mfu = model.model_flops_per_step() / (step * context.total_peak)
    return Evaluation(step_s=step, pipeline_s=pipeline, dp_exposed_s=data_parallel.exposed,
                      dp_total_s=data_parallel.total, framework_s=framework, num_micro_batches=m, times=times,
                      memory_bytes=memory, memory_ratio=ratio, mfu=mfu)


def _measured_sharding(model: ModelSpec, constants: CostConstants, context: LayoutContext,
                       rows: Rows) -> np.ndarray | None:
    if constants.calibration is None:
        return None
    layout = context.layout
    return constants.calibration.sharding_seconds(model, layout.tp, layout.dp, context.stage_peak,
                                                  rows.micro_batch * model.seq_len / rows.cp)


def _measured_zero_steps(model: ModelSpec, constants: CostConstants, context: LayoutContext,
                         rows: Rows) -> dict[int, np.ndarray]:
    """ZeRO-1/2's measured seconds per layer and step, where the layout runs them on DeepSpeed (no TP, no
    pipeline: `runtime/auto_plan.layout_from_plan`; beside them the engines run DDP)."""
    layout = context.layout
    if constants.calibration is None or layout.tp > 1 or layout.pp > 1:
        return {}
    measured = {stage: constants.calibration.sharding_seconds(model, layout.tp, layout.dp, context.stage_peak,
                                                              rows.micro_batch * model.seq_len / rows.cp, stage)
                for stage in (1, 2)}
    return {stage: seconds for stage, seconds in measured.items() if seconds is not None}


def framework_seconds(model: ModelSpec, constants: CostConstants, context: LayoutContext, stage_dense, stage_expert,
                      *, ep, zero) -> np.ndarray:
    """Gradient clipping and the optimizer's update of the parameters a device owns (all of them, or its
    ZeRO shard) on the worst stage, plus the step's fixed cost; zero where calibration measured neither.
    Measured per layer and head at the layout's TP degree where calibration has the model's shapes
    (DTensor's per-parameter cost included), else per parameter."""
    calibration = constants.calibration
    if calibration is None:
        return np.zeros(len(np.atleast_1d(zero)))
    layout = context.layout
    ep = np.asarray(ep, dtype=np.float64)[:, None]
    shards = np.where((np.asarray(zero) >= 1)[:, None], layout.dp, 1.0)
    dense = np.asarray(stage_dense, dtype=np.float64)[None, :] / layout.tp
    expert = np.asarray(stage_expert, dtype=np.float64)[None, :] / (layout.tp * ep)
    per_param = calibration.optimizer_s_per_param or 0.0
    owned = per_param * (dense + expert)
    measured = calibration.optimizer_seconds(model, layout.tp, context.stage_peak)
    if measured is not None:
        layers = np.asarray(context.stage_layers, dtype=np.float64)[None, :]
        is_last = (np.arange(layout.pp) == layout.pp - 1)[None, :]
        outside = dense - layers * model.dense_layer_params / layout.tp - is_last * model.vocab_size * model.hidden / layout.tp
        owned = layers * measured[0] + is_last * measured[1] + per_param * (np.maximum(outside, 0.0) + expert)
    return (owned / shards).max(axis=1) + (calibration.step_overhead_s or 0.0)


def split_layers(num_layers: int, layer_s: np.ndarray, extra_s: np.ndarray) -> np.ndarray | None:
    """Layers per stage minimizing the slowest stage, stage time = layers * layer_s[i] + extra_s[i].

    Equal stages get equal shares; faster stages get proportionally more. Assigning identical
    layers one at a time to the stage that would finish earliest is optimal for makespan over
    related machines with identical jobs (exchange argument). Stages of equal chips must divide
    the layers evenly (Megatron-LM's rule); None when they cannot.
    """
    pp = len(layer_s)
    if np.allclose(layer_s, layer_s[0], rtol=1e-12):
        return np.full(pp, num_layers // pp) if num_layers % pp == 0 else None
    layers = np.ones(pp, dtype=np.int64)
    heap = [(2 * layer_s[i] + extra_s[i], i) for i in range(pp)]
    heapq.heapify(heap)
    for _ in range(num_layers - pp):
        _, stage = heapq.heappop(heap)
        layers[stage] += 1
        heapq.heappush(heap, ((layers[stage] + 1) * layer_s[stage] + extra_s[stage], stage))
    return layers


def row_grid(model: ModelSpec, *, dp: int, pp: int, zero_stages, recomputes, max_micro_batch: int,
             expert_parallel_zero_stages: tuple[int, ...] = (0, 1, 2, 3), tp: int = 1) -> Rows:
    """Every (ep, cp and its kind, ZeRO, micro-batch, recompute) row valid for a layout with this dp, pp and tp."""
    eps = [e for e in range(1, max(model.num_experts, 1) + 1)
           if max(model.num_experts, 1) % e == 0 and dp % e == 0]
    zeros = [z for z in zero_stages if z <= 1 or pp == 1]  # DeepSpeed: pipelines combine with ZeRO-1 only
    blocks = []
    for cp, ulysses in context_parallel_choices(model, dp=dp, pp=pp, tp=tp):
        per_replica = model.global_batch // (dp // cp)
        batches = [b for b in range(1, min(per_replica, max_micro_batch) + 1) if per_replica % b == 0]
        # CP runs beside DDP or FSDP2 (ZeRO 0 or 3), not DeepSpeed's ZeRO-1/2
        stages = zeros if cp == 1 else [z for z in zeros if z in (0, 3)]
        # Beside CP an expert group takes one CP rank of each of ep replicas (the engines' mesh; ZeRO-3 there
        # is FSDP2, as DeepSpeed's expert groups span data-parallel ranks only)
        experts = [e for e in eps if (dp // cp) % e == 0]
        grid = np.array(np.meshgrid(experts, stages, batches, recomputes, indexing="ij")).reshape(4, -1)
        grid = grid[:, (grid[0] == 1) | np.isin(grid[1], expert_parallel_zero_stages)]
        blocks.append(np.vstack([grid, np.full(grid.shape[1], cp), np.full(grid.shape[1], int(ulysses))]))
    grid = np.hstack(blocks) if blocks else np.zeros((6, 0), dtype=np.int64)
    return Rows(ep=grid[0], zero=grid[1], micro_batch=grid[2], recompute=grid[3], cp=grid[4],
                ulysses=grid[5].astype(bool))


def context_parallel_choices(model: ModelSpec, *, dp: int, pp: int, tp: int) -> list[tuple[int, bool]]:
    """(cp, Ulysses or ring) pairs the engines run for this layout: cp dividing dp into dp / cp replicas that
    split the global batch, with the sequence in 2 x cp equal chunks, for a model they run it on
    (ModelSpec.context_parallel), without pipelining; Ulysses where the TP rank's heads divide by cp.
    (1, False) wherever dp splits the batch."""
    choices = [(1, False)] if model.global_batch % dp == 0 else []
    if not model.context_parallel or pp > 1:
        return choices
    for cp in range(2, dp + 1):
        if dp % cp or model.seq_len % (2 * cp) or model.global_batch % (dp // cp):
            continue
        choices.append((cp, False))
        if (model.num_heads // tp) % cp == 0:
            choices.append((cp, True))
    return choices
