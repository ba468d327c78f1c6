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

Data parallel (ZeRO sec. 7: ZeRO-1/2 move the same 2 Psi as all-reduce, ZeRO-3 3 Psi):
gradient reduction overlaps with the backward pass of the last micro-batch (bucketed
reduction, Li et al. 2020, PyTorch DDP); ZeRO-0 all-reduces once per step; ZeRO-1
reduce-scatters once and all-gathers updated weights after the optimizer (not
overlapped); ZeRO-2 reduce-scatters every micro-batch (only gradient shards are kept)
and all-gathers weights once; ZeRO-3 all-gathers weights before each forward and
backward (prefetched: overlapped with that pass) and reduce-scatters during backward.
The optimizer update itself (memory-bound, < 1% of a large step) is not priced.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from baige_ray.planner.links import GroupLink
from baige_ray.planner.model_spec import ModelSpec


@dataclass(kw_only=True, frozen=True)
class CostConstants:
    max_efficiency: float = 0.6  # Megatron-LM sustains 44-52% of A100 peak on GPT-3 (Narayanan 2021, table 1)
    machine_balance: float = 200.0  # peak FLOP/s over HBM bytes/s: A100 156, H100 295


def all_reduce(n, size, link: GroupLink) -> np.ndarray:
    n = np.asarray(n, dtype=np.float64)
    ring = 2 * (n - 1) * link.latency + 2 * (n - 1) / n * size / link.bandwidth
    tree = 2 * np.ceil(np.log2(np.maximum(n, 1))) * link.latency + 2 * size / link.bandwidth
    return np.where(n > 1, np.minimum(ring, tree), 0.0)


def reduce_scatter(n, size, link: GroupLink) -> np.ndarray:
    """Also all-gather and pairwise all-to-all: every rank sends (n-1)/n of its bytes."""
    n = np.asarray(n, dtype=np.float64)
    return np.where(n > 1, (n - 1) * link.latency + (n - 1) / n * size / link.bandwidth, 0.0)


def point_to_point(size, link: GroupLink) -> np.ndarray:
    return link.latency + size / link.bandwidth


def efficiency(model: ModelSpec, micro_batch, tp: int, constants: CostConstants) -> np.ndarray:
    m = np.asarray(micro_batch, dtype=np.float64) * model.seq_len
    k = float(model.hidden)
    n = (model.expert_ffn if model.is_moe else model.ffn_hidden) / tp
    intensity = 2 * m * k * n / (model.dtype_bytes * (m * k + k * n + m * n))
    return constants.max_efficiency * np.minimum(1.0, intensity / constants.machine_balance)


@dataclass(kw_only=True)
class StageTimes:
    """Per micro-batch seconds, shape (rows, stages)."""

    forward: np.ndarray
    backward: np.ndarray
    tp: np.ndarray
    ep: np.ndarray
    pp: np.ndarray

    @property
    def total(self) -> np.ndarray:
        return self.forward + self.backward + self.tp + self.ep + self.pp


def stage_times(model: ModelSpec, constants: CostConstants, *, stage_layers, stage_peak, tp: int, pp: int,
                links: dict[str, GroupLink], ep, micro_batch, recompute) -> StageTimes:
    layers = np.asarray(stage_layers, dtype=np.float64)[None, :]
    is_last = (np.arange(pp) == pp - 1)[None, :]
    b = np.asarray(micro_batch, dtype=np.float64)[:, None]
    recompute = np.asarray(recompute)[:, None]
    tokens = b * model.seq_len
    forward_flops = tokens * (layers * model.layer_flops_per_token + is_last * model.logits_flops_per_token)
    redo = np.select([recompute == 1, recompute == 2], [model.attention_core_flops_per_token,
                                                        model.layer_flops_per_token], 0.0)
    backward_flops = 2 * forward_flops + tokens * layers * redo
    rate = tp * np.asarray(stage_peak)[None, :] * efficiency(model, b, tp, constants)
    activation = tokens * model.hidden * model.dtype_bytes
    tp_collectives = 4 + 2 * (recompute == 2)
    tp_time = layers * tp_collectives * all_reduce(tp, activation, links["tp"])
    ep_time = np.zeros_like(tp_time)
    if model.is_moe:
        for size in np.unique(ep):
            routed = reduce_scatter(size, activation * model.top_k / tp, links[f"ep{int(size)}"])
            ep_time = np.where(np.asarray(ep)[:, None] == size, layers * model.moe_layer_share * 4 * routed, ep_time)
    pp_time = 2 * point_to_point(activation / tp, links["pp"]) if pp > 1 else np.zeros_like(tokens)
    return StageTimes(forward=forward_flops / rate, backward=backward_flops / rate, tp=tp_time, ep=ep_time,
                      pp=np.broadcast_to(pp_time, tp_time.shape))


def pipeline_seconds(stage_total: np.ndarray, num_micro_batches) -> np.ndarray:
    m = np.asarray(num_micro_batches, dtype=np.float64)
    return stage_total.sum(axis=1) + (m - 1) * stage_total.max(axis=1)


def data_parallel_exposed(model: ModelSpec, times: StageTimes, *, stage_dense, stage_expert, tp: int, dp: int,
                          link: GroupLink, ep, zero, num_micro_batches) -> np.ndarray:
    """Seconds of gradient reduction / ZeRO gathers not hidden behind compute, worst stage."""
    ep = np.asarray(ep, dtype=np.float64)[:, None]
    zero = np.asarray(zero)[:, None]
    m = np.asarray(num_micro_batches, dtype=np.float64)[:, None]
    dense = model.dtype_bytes * np.asarray(stage_dense)[None, :] / tp
    expert = model.dtype_bytes * np.asarray(stage_expert)[None, :] / (tp * ep)
    all_red = all_reduce(dp, dense, link) + all_reduce(dp / ep, expert, link)
    half = reduce_scatter(dp, dense, link) + reduce_scatter(dp / ep, expert, link)
    exposed = np.select(
        [zero == 0, zero == 1, zero == 2],
        [np.maximum(0.0, all_red - times.backward),
         np.maximum(0.0, half - times.backward) + half,
         m * np.maximum(0.0, half - times.backward) + half],
        m * (np.maximum(0.0, half - times.forward) + np.maximum(0.0, 2 * half - times.backward)))
    return exposed.max(axis=1)
