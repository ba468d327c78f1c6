"""Time per training step of one layout, for many (ep, ZeRO, micro-batch, recompute) rows at once.

Collectives use the alpha-beta model (Hockney 1994; Thakur, Rabenseifner & Gropp 2005,
"Optimization of Collective Communication Operations in MPICH"), alpha = latency of the
slowest link the group spans, beta = 1 / its bandwidth, M = bytes per rank:
  ring all-reduce       2(n-1) alpha + 2 (n-1)/n M beta
  tree all-reduce       2 ceil(log2 n) alpha + 2 M beta   (NCCL double binary tree; NCCL
                        picks the faster of ring and tree, so we take the minimum)
  reduce-scatter, all-gather, all-to-all (pairwise)   (n-1) alpha + (n-1)/n M beta
  point-to-point        alpha + M beta

Compute: forward FLOPs per token per layer from `ModelSpec.layer_flops_per_token`
(Narayanan et al. 2021 eq. 3), backward = 2x forward, full recomputation adds one forward,
selective adds the attention core (Korthikanti et al. 2022). A chip sustains
peak_tflops x efficiency, efficiency = max_efficiency x min(1, I / machine_balance) with I
the arithmetic intensity of the layer's largest GEMM (b*s x h x ffn/t): a roofline
(Williams et al. 2009) that makes small micro-batches and wide TP pay. The descriptor's
peak_tflops already encodes chip speed, so relative_speed is not applied on top of it.

Communication per micro-batch and layer (Narayanan et al. 2021 sec. 3.2 / Korthikanti
sec. 4.2.2): 2 TP all-reduces forward and 2 backward of b*s*h elements (with sequence
parallelism the all-gather + reduce-scatter pairs move the same bytes), 2 more under
full recomputation; MoE layers add 2 all-to-alls forward and 2 backward of the routed
b*s*h*top_k/t elements. Pipeline stages exchange b*s*h/t elements per micro-batch each way
(scatter/gather optimization, Narayanan et al. 2021 sec. 4.1). TP, EP and pipeline traffic
sit on the critical path (not overlapped).

Pipeline: 1F1B with stage times T_i per micro-batch takes sum_i T_i + (m - 1) max_i T_i
(Narayanan et al. 2019, PipeDream; for equal stages (m + p - 1) T, bubble fraction (p-1)/m
as in GPipe, Huang et al. 2019; the uneven form is DAPPLE, Fan et al. 2021).

Data parallel and ZeRO traffic, and how much of it compute hides, are priced in overlap.py.
The optimizer update and the step's fixed cost are priced only where calibration measured
them (nominal: memory-bound, < 1% of a large step).

With a `Calibration` (calibration.py) the measured FLOP/s of the model's own layer and head
shapes replace peak x efficiency, per chip, TP degree and micro-batch (measured through DTensor
when TP > 1, so they hold the TP collectives of the tier the probe's groups spanned and none are
added on top); measured link tiers replace the descriptor's (links.py); the measured overlap
share replaces the nominal 1.0; a measured host sharing above 1 (simulated devices sharing a
host's cores) lets a pipeline bubble lend its cores to the busy stages (`pipeline_seconds`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from baige_ray.planner.calibration import Calibration
from baige_ray.planner.links import GroupLink, expert_link_key
from baige_ray.planner.model_spec import ModelSpec


@dataclass(kw_only=True, frozen=True)
class CostConstants:
    max_efficiency: float = 0.6  # Megatron-LM sustains 44-52% of A100 peak on GPT-3 (Narayanan 2021, table 1)
    machine_balance: float = 200.0  # peak FLOP/s over HBM bytes/s: A100 156, H100 295
    overlap: float = 1.0  # share of a background collective compute hides: NCCL on its own SMs and copy engines
    ddp_bucket_bytes: float = 25 * 2**20  # torch DDP's bucket_cap_mb default: the last bucket nothing hides
    # ZeRO stages whose gradient reductions overlap backward. Megatron's distributed optimizer and
    # DeepSpeed with overlap_comm do for every stage; DeepSpeed's default turns it on for ZeRO-3 only,
    # which is what baige-ray's engines run (runtime/auto_plan.py plans with (0, 3)).
    overlapped_zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    calibration: Calibration | None = field(default=None, compare=False)

    @property
    def host_sharing(self) -> float:
        measured = self.calibration.host_sharing if self.calibration is not None else None
        return 1.0 if measured is None else measured

    @property
    def sharing_measured_at(self) -> float | None:
        return self.calibration.host_sharing_measured_at if self.calibration is not None else None

    @property
    def overlap_share(self) -> float:
        measured = self.calibration.overlap if self.calibration is not None else None
        return self.overlap if measured is None else measured


def _issued(n, size) -> np.ndarray:
    """Whether a collective of `size` bytes over `n` ranks is issued at all: an empty one (a dense
    model's expert gradients) costs not even its latency."""
    return (n > 1) & (np.asarray(size) > 0)


def all_reduce(n, size, link: GroupLink) -> np.ndarray:
    n = np.asarray(n, dtype=np.float64)
    bandwidth, latency = link.for_kind("all_reduce")
    ring = 2 * (n - 1) * latency + 2 * (n - 1) / n * size / bandwidth
    if link.kinds:  # measured: the fit already is whatever algorithm the library picked
        return np.where(_issued(n, size), ring, 0.0)
    tree = 2 * np.ceil(np.log2(np.maximum(n, 1))) * latency + 2 * size / bandwidth
    return np.where(_issued(n, size), np.minimum(ring, tree), 0.0)


def reduce_scatter(n, size, link: GroupLink, kind: str = "reduce_scatter") -> np.ndarray:
    """Also all-gather and pairwise all-to-all (`kind`): every rank sends (n-1)/n of its bytes."""
    n = np.asarray(n, dtype=np.float64)
    bandwidth, latency = link.for_kind(kind)
    return np.where(_issued(n, size), (n - 1) * latency + (n - 1) / n * size / bandwidth, 0.0)


def point_to_point(size, link: GroupLink) -> np.ndarray:
    bandwidth, latency = link.for_kind("send_recv")
    return latency + size / bandwidth


def efficiency(model: ModelSpec, micro_batch, tp: int, constants: CostConstants) -> np.ndarray:
    m = np.asarray(micro_batch, dtype=np.float64) * model.seq_len
    k = float(model.hidden)
    n = (model.expert_ffn if model.is_moe else model.ffn_hidden) / tp
    intensity = 2 * m * k * n / (model.dtype_bytes * (m * k + k * n + m * n))
    return constants.max_efficiency * np.minimum(1.0, intensity / constants.machine_balance)


def device_rates(model: ModelSpec, constants: CostConstants, micro_batch, tp: int,
                 stage_peak) -> tuple[np.ndarray, np.ndarray]:
    """FLOP/s one device sustains on its decoder layers and on the LM head, shape (rows, stages):
    measured curves where calibration has the chip and shapes, else peak x efficiency."""
    b = np.asarray(micro_batch, dtype=np.float64).reshape(-1, 1)
    peaks = np.asarray(stage_peak, dtype=np.float64).reshape(1, -1)
    layer = np.array(np.broadcast_to(peaks * efficiency(model, b, tp, constants), (len(b), peaks.shape[1])))
    head = layer.copy()
    if constants.calibration is not None:
        for peak in np.unique(peaks[0]):  # one look-up per chip, not per stage (pipelines run to 100+ stages)
            curves = constants.calibration.curves(model, tp, float(peak))
            if curves is not None:
                stages = peaks[0] == peak
                layer[:, stages] = curves[0].rate(b * model.seq_len)
                head[:, stages] = curves[1].rate(b * model.seq_len)
    return layer, head


def best_device_rate(model: ModelSpec, constants: CostConstants, tp: int, peak: float, largest_batch: int) -> float:
    """No micro-batch up to `largest_batch` runs a device faster than this (for the search's bound)."""
    nominal = peak * float(efficiency(model, largest_batch, tp, constants))
    curves = constants.calibration.curves(model, tp, peak) if constants.calibration is not None else None
    return nominal if curves is None else max(curves[0].best, curves[1].best)


@dataclass(kw_only=True)
class StageTimes:
    """Per micro-batch seconds, shape (rows, stages)."""

    forward: np.ndarray
    backward: np.ndarray
    tp: np.ndarray
    ep: np.ndarray
    pp: np.ndarray
    cp: np.ndarray | float = 0.0  # context parallelism's exchanges (planner/context_parallel.py)

    @property
    def total(self) -> np.ndarray:
        return self.forward + self.backward + self.tp + self.ep + self.pp + self.cp


def stage_times(model: ModelSpec, constants: CostConstants, *, stage_layers, stage_peak, tp: int, pp: int,
                links: dict[str, GroupLink], ep, micro_batch, recompute, cp=None,
                cp_exchanges=None) -> StageTimes:
    """`cp` (one per row, None: 1) context-parallel ranks share each sequence: a rank computes 1/cp of the
    micro-batch's tokens, each attending to the whole sequence's keys as one process's do; their exchanges
    (`cp_exchanges`, planner/context_parallel.py's CPExchangeSeconds) add what the attention to the rank's
    own keys, 1/cp of its attention, does not hide."""
    layers = np.asarray(stage_layers, dtype=np.float64)[None, :]
    is_last = (np.arange(pp) == pp - 1)[None, :]
    cp = np.ones(len(np.atleast_1d(micro_batch))) if cp is None else np.asarray(cp, dtype=np.float64)
    share = np.asarray(micro_batch, dtype=np.float64) / cp  # sequences' worth of tokens on this rank
    b = share[:, None]
    recompute = np.asarray(recompute)[:, None]
    tokens = b * model.seq_len
    layer_rate, head_rate = device_rates(model, constants, share, tp, stage_peak)
    layer_rate, head_rate = tp * layer_rate, tp * head_rate
    layer_forward = tokens * layers * model.layer_flops_per_token / layer_rate
    head_forward = tokens * is_last * model.logits_flops_per_token / head_rate
    redo = np.select([recompute == 1, recompute == 2], [model.attention_core_flops_per_token,
                                                        model.layer_flops_per_token], 0.0)
    forward = layer_forward + head_forward
    backward = 2 * forward + tokens * layers * redo / layer_rate
    activation = tokens * model.hidden * model.dtype_bytes
    tp_collectives = 4 + 2 * (recompute == 2)
    tp_time = layers * tp_collectives * all_reduce(tp, activation, links["tp"])
    calibration = constants.calibration
    if calibration is not None and calibration.tensor_parallel_included(model, tp, stage_peak, links["tp"].tier):
        tp_time = np.zeros_like(tp_time)  # measured with the layer: DTensor's TP collectives, loaded
    ep_time = np.zeros_like(tp_time)
    if model.is_moe:
        ep = np.broadcast_to(np.asarray(ep), cp.shape)
        for size, context in sorted(set(zip(ep.tolist(), cp.astype(int).tolist()))):
            link = links[expert_link_key(int(size), context)]
            routed = reduce_scatter(size, activation * model.top_k / tp, link, "all_to_all")
            rows = (ep == size) & (cp == context)
            ep_time = np.where(rows[:, None], layers * model.moe_layer_share * 4 * routed, ep_time)
    pp_time = 2 * point_to_point(activation / tp, links["pp"]) if pp > 1 else np.zeros_like(tokens)
    cp_time = 0.0
    if cp_exchanges is not None:
        own_attention = tokens * model.attention_core_flops_per_token / layer_rate / cp[:, None]
        cp_time = layers * cp_exchanges.exposed(own_attention)
    return StageTimes(forward=forward, backward=backward, tp=tp_time, ep=ep_time,
                      pp=np.broadcast_to(pp_time, tp_time.shape), cp=cp_time)


def pipeline_seconds(stage_total: np.ndarray, num_micro_batches, host_sharing: float = 1.0,
                     sharing_measured_at: float | None = None) -> np.ndarray:
    """1F1B's critical path. Where devices share a host's cores (`host_sharing` > 1, measured with
    `sharing_measured_at` of the devices busy) stages a bubble idles lend their cores to the busy ones:
    with c = min(m, stages) busy at once, each computes `sharing_speedup` times faster, so the step is
    at least the busiest stage's work and the pipeline's whole work at that speed, and at least the
    critical path sped up by the full sharing."""
    m = np.asarray(num_micro_batches, dtype=np.float64)
    critical = stage_total.sum(axis=1) + (m - 1) * stage_total.max(axis=1)
    if host_sharing <= 1.0:
        return critical
    stages = stage_total.shape[1]
    busy = np.minimum(m, stages)
    speedup = sharing_speedup(busy / stages, host_sharing, sharing_measured_at)
    busiest = m * stage_total.max(axis=1) / speedup
    whole = m * stage_total.sum(axis=1) / (busy * speedup)
    return np.maximum(np.maximum(busiest, whole), critical / host_sharing)


def sharing_speedup(busy_share, host_sharing: float, measured_at: float | None) -> np.ndarray:
    """How much faster a device computes while only `busy_share` of the devices compute. The host's cores
    are shared out evenly among the busy devices (a time-sliced CPU): 1 / busy_share times faster, up to
    the measured `host_sharing`, what a device gains with the cores to itself. Where the measurement
    (at `measured_at` of the devices busy; None: 1 / host_sharing) gained more than its even share,
    the curve steepens to pass through it."""
    share = np.clip(np.asarray(busy_share, dtype=np.float64), 1e-9, 1.0)
    measured_at = measured_at if measured_at is not None else 1.0 / host_sharing
    if host_sharing <= 1.0 or measured_at >= 1.0:
        return np.ones_like(share)
    steepness = max(1.0, np.log(host_sharing) / -np.log(measured_at))
    return np.minimum(share ** -steepness, host_sharing)
