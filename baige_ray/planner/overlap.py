"""Data-parallel and ZeRO traffic per step, and how much of it compute hides, as the engines schedule it.

A background collective of X seconds beside C seconds of compute costs `hide(X, C) = X - eta
min(X, C)`, eta the overlap share (CostConstants.overlap_share: 1.0 nominal for NCCL on GPUs,
measured by calibration). With eta = 1 that is max(0, X - C): perfectly hidden when compute is
longer. Per stage (the worst stage decides), with m micro-batches, F / B one micro-batch's
forward / backward compute, L the stage's layers, `ag` the all-gather (= reduce-scatter) of one
layer's weights over the data-parallel group, `ag_out` that of the weights outside the layers
(embedding, head, final norm), AR / RS / AG of the stage's whole gradient or weights:

  ZeRO-0 (DDP, PyTorch DDP paper, Li et al. 2020): gradients are all-reduced in buckets during
    the last micro-batch's backward (no_sync before it); the last bucket (the first layers and
    the embedding) is ready only when backward ends, so nothing hides it:
      exposed = max(AR(bucket), hide(AR, B))
    Beside tensor or expert parallelism (DTensor parameters, which DDP cannot wrap) the engine
    all-reduces the gradients after backward: nothing hides them (exposed = AR).
  ZeRO-1 (ZeRO sec. 5.1): gradients reduce-scattered during the last backward, updated weights
    all-gathered after the optimizer (nothing to hide behind):  hide(RS, B) + AG
  ZeRO-2: gradient shards only, so every micro-batch reduce-scatters:  m hide(RS, B) + AG
    DeepSpeed overlaps these reductions only with `overlap_comm`, off by default below ZeRO-3
    (CostConstants.overlapped_zero_stages); then hide(RS, B) is RS.
    Where calibration measured what DeepSpeed's ZeRO-1/2 step adds to a layer on this cluster (Z per
    layer and step, one micro-batch: the gradients reduced into partitions, the flat buffers copied, the
    weights gathered), that replaces the layer terms; ZeRO-2's further micro-batches reduce again:
      ZeRO-1 exposed = RS_out + AG_out + L Z,   ZeRO-2 exposed = RS_out + AG_out + L Z + (m - 1) RS
    (8 ranks on 2 cores: DeepSpeed's ZeRO-1/2 steps ran 0.10-0.16 s over DDP's, the links priced them
    within 12 ms of it.)
  ZeRO-3 / FSDP2 (ZeRO sec. 5.3, FSDP paper Zhao et al. 2023 sec. 3.3): every micro-batch gathers
    each layer before its forward and again before its backward, with one layer prefetched
    behind the compute of the layer before; the first gather of each pass, the weights outside
    the layers and the last reduce-scatter are exposed:
      forward  = ag_out + ag + (L - 1) hide(ag, F / L)
      backward = ag + (L - 1) hide(ag + rs, B / L) + rs + rs_out     (gather + reduce-scatter per layer)
      exposed  = m (forward + backward)
    Where calibration measured what FSDP2's per-layer gathers and reduce-scatters add to a layer on
    this cluster (S per layer and micro-batch, hidden or not), that replaces the layer terms:
      exposed  = m (ag_out + rs_out + L S)
TP, EP and pipeline traffic are on the critical path (cost.py), so the DP traffic hides behind
compute only, not behind them: TP and DP sharing a NIC are not double counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from baige_ray.planner.cost import CostConstants, StageTimes, all_reduce, reduce_scatter
from baige_ray.planner.links import GroupLink
from baige_ray.planner.model_spec import ModelSpec


@dataclass(kw_only=True)
class DataParallelCost:
    """Seconds per step, worst stage, shape (rows,): the traffic and the part compute does not hide."""

    total: np.ndarray
    exposed: np.ndarray


def hide(collective, compute, overlap: float) -> np.ndarray:
    """Seconds a background collective adds beside `compute` seconds of work."""
    collective = np.asarray(collective, dtype=np.float64)
    return collective - overlap * np.minimum(collective, compute)


def data_parallel_cost(model: ModelSpec, times: StageTimes, constants: CostConstants, *, stage_layers,
                       stage_dense, stage_expert, tp: int, dp: int, link: GroupLink, ep, zero,
                       num_micro_batches, measured_sharding=None, measured_zero_steps=None) -> DataParallelCost:
    """`measured_sharding`: (rows,) seconds ZeRO-3 sharding adds per layer and micro-batch, measured by
    calibration for this TP degree and data-parallel group, or None (priced from the links).
    `measured_zero_steps`: {1: (rows,), 2: (rows,)} seconds DeepSpeed's ZeRO-1 / ZeRO-2 add per layer and
    step, measured likewise; a stage missing from it is priced from the links."""
    ep = np.asarray(ep, dtype=np.float64)[:, None]
    zero = np.asarray(zero)[:, None]
    m = np.asarray(num_micro_batches, dtype=np.float64)[:, None]
    layers = np.asarray(stage_layers, dtype=np.float64)[None, :]
    dtype = model.dtype_bytes
    dense = dtype * np.asarray(stage_dense, dtype=np.float64)[None, :] / tp
    expert = dtype * np.asarray(stage_expert, dtype=np.float64)[None, :] / (tp * ep)
    layer_dense = dtype * model.dense_layer_params / tp
    layer_expert = dtype * model.expert_layer_params / (tp * ep)
    outside = dense - layers * layer_dense

    def gather(dense_bytes, expert_bytes, kind: str = "all_gather") -> np.ndarray:
        return reduce_scatter(dp, dense_bytes, link, kind) + reduce_scatter(dp / ep, expert_bytes, link, kind)

    eta = constants.overlap_share
    full_reduce = all_reduce(dp, dense, link) + all_reduce(dp / ep, expert, link)
    half, scatter = gather(dense, expert), gather(dense, expert, "reduce_scatter")
    bucketed = np.maximum(all_reduce(dp, np.minimum(dense + expert, constants.ddp_bucket_bytes), link),
                          hide(full_reduce, times.backward, eta))
    ddp = np.where((ep > 1) | (tp > 1), full_reduce, bucketed)
    ag, ag_out = gather(layer_dense, layer_expert), gather(outside, 0.0)
    rs, rs_out = gather(layer_dense, layer_expert, "reduce_scatter"), gather(outside, 0.0, "reduce_scatter")
    forward = ag_out + ag + (layers - 1) * hide(ag, times.forward / layers, eta)
    backward = ag + rs + rs_out + (layers - 1) * hide(ag + rs, times.backward / layers, eta)
    sharded = forward + backward
    if measured_sharding is not None:
        sharded = ag_out + rs_out + layers * np.asarray(measured_sharding, dtype=np.float64)[:, None]
    overlapped = np.isin(zero, constants.overlapped_zero_stages)
    reduction = np.where(overlapped, hide(scatter, times.backward, eta), scatter)
    low_stages = {1: reduction + half, 2: m * reduction + half}
    for stage, per_layer in (measured_zero_steps or {}).items():
        measured_step = ag_out + rs_out + layers * np.asarray(per_layer, dtype=np.float64)[:, None]
        low_stages[stage] = measured_step + (m - 1) * reduction if stage == 2 else measured_step
    exposed = np.select([zero == 0, zero == 1, zero == 2], [ddp, low_stages[1], low_stages[2]], m * sharded)
    total = np.select([zero == 0, zero == 1, zero == 2], [full_reduce, scatter + half, m * scatter + half],
                      m * (ag_out + rs_out + layers * (2 * ag + rs)))
    total = np.broadcast_to(total, exposed.shape)
    worst = np.argmax(exposed, axis=1)
    rows = np.arange(exposed.shape[0])
    return DataParallelCost(total=total[rows, worst], exposed=exposed[rows, worst])
