"""Bytes per device: model states under ZeRO and activations under recomputation.

Assumptions (stated, each a knob of the formulas below):
  * Mixed-precision Adam (Rajbhandari et al. 2020, "ZeRO", sec. 3.1): per parameter
    `dtype_bytes` of weights, `dtype_bytes` of gradients and K bytes of optimizer state
    (fp32 master copy + momentum + variance = 12 when training in 16 bit, 8 in fp32).
    ZeRO-1 shards optimizer state over the data-parallel group, ZeRO-2 also gradients,
    ZeRO-3 also weights (ZeRO sec. 5); ZeRO-3 holds two gathered layers (one prefetched).
  * Expert weights are sharded over expert-parallel ranks; their ZeRO group is the
    `dp / ep` replicas holding the same experts.
  * Activations per layer per micro-batch (Korthikanti et al. 2022, "Reducing Activation
    Recomputation in Large Transformer Models", sec. 4): attention 7sbh + 4sb*kv_dim (11sbh for
    MHA), MLP 3sbh + 4sb*ffn (19sbh for ffn = 4h; 8sb*ffn for a gated MLP's four inner tensors, as
    transformers' Llama keeps them), two layer norms 4sbh, and 5as^2b for
    softmax/dropout of the scores. Selective recomputation drops the 5as^2b term (sec. 5), and so
    does a fused attention kernel, which never keeps the scores (ModelSpec.fused_attention: SDPA's
    flash and memory-efficient kernels, as transformers runs a model); full recomputation keeps only
    each layer's 2sbh input plus one layer's working set. With context parallelism a rank keeps the
    activations of its 1/cp of the tokens, and one layer at a time holds the whole sequence's keys
    and values and their gradients.
    Under TP, as the engines run it: what lies inside the TP regions (queries, keys, values, the
    output projection's input, the MLP's inner activations, the scores) divides by t. The norms
    and the dropout masks on the residual stream (6sbh) divide by t only with sequence
    parallelism (parallel/sequence_parallel.py, on for dense models; an MoE layer takes the whole
    sequence). The inputs of the column-parallel projections (2sbh for QKV, 2sbh for the MLP)
    never do: torch's sequence parallelism gathers them and the matmuls save them whole, where
    Megatron-LM keeps the slice and gathers again in backward. So a dense MHA layer (ffn = 4h) keeps
    4sbh + 30sbh/t with it (eq. 5 says 34sbh/t), 10sbh + 24sbh/t without (eq. 4), scores aside.
  * 1F1B keeps up to (pp - stage) micro-batches in flight on a stage, at most the number
    of micro-batches (Narayanan et al. 2021, sec. 2.2.1), so stage 0 holds the most.
  * The last stage holds LOGIT_BYTES per logit at the loss: the head's logits, their fp32 copy for
    the loss, its log-softmax (kept for backward) and the gradient: 12 bytes, counted from what the
    loss allocates, not measured apart (bench scale measures only each worker's whole peak). The vocabulary-parallel head gathers its logits on every TP rank (no
    loss parallelism, unlike Korthikanti sec. 4.3's vocab/t).
  * ZeRO-3 (FSDP2, DeepSpeed) also gathers the weights outside the layers (embedding, head) whole,
    and their gradient before it is reduce-scattered: in `dtype_bytes`, plus an fp32 copy of the
    gradient (the reduction's precision). With a 151,936-token vocabulary that unit is 9x a layer.
  * A fraction of device memory (CUDA context, NCCL buffers, allocator fragmentation) is
    not usable; `PlanOptions.usable_memory_fraction`.
"""

from __future__ import annotations

import numpy as np

from baige_ray.planner.model_spec import ModelSpec

RECOMPUTE = ("none", "selective", "full")
LOGIT_BYTES = 12.0


def optimizer_bytes_per_param(model: ModelSpec) -> int:
    """Adam moments in fp32 (8 bytes), plus an fp32 master copy when weights are lower precision."""
    return 8 + (4 if model.dtype_bytes < 4 else 0)


GATHERED_INPUTS = 4  # x sbh: the QKV and MLP input projections' inputs, whole on every TP rank
RESIDUAL_STREAM = 6  # x sbh: the two norms' activations and the two dropout masks, outside the TP regions
GATED_INNER_BYTES = 8  # x sb x ffn: a SwiGLU MLP's four inner tensors (gate, up, silu(gate), their product)


def activation_bytes_per_layer(model: ModelSpec, micro_batch, recompute, tp: int,
                               sequence_parallel: bool = True, cp=1) -> np.ndarray:
    """Stored activation bytes of one layer for one micro-batch (`recompute` is an index into RECOMPUTE)
    on a TP rank; `sequence_parallel` where the layout asks for it (the model must offer it too); `cp`
    context-parallel ranks, each holding 1/cp of the sequence, whose attention keeps nothing of the others'
    keys for backward (parallel/context_parallel.py: both kinds keep its own tokens' activations only)."""
    h, b = model.hidden, np.asarray(micro_batch, dtype=np.float64)
    s = model.seq_len / cp  # this rank's tokens: every saved tensor is per token, the scores per query
    share = model.moe_layer_share  # MoE layers store their k experts' and the shared experts' activations
    # A GELU MLP keeps its activation's input and output (4 bytes of 16-bit per inner unit); a gated one
    # (SwiGLU) keeps the gate's and the up projection's outputs, the activation's output and the product.
    inner = GATED_INNER_BYTES if model.gated_mlp else 4
    mlp = 3 * h + share * inner * (model.top_k * model.expert_ffn + model.shared_expert_ffn) \
        + (1 - share) * inner * model.ffn_hidden
    per_token = 7 * h + 4 * model.kv_dim + 4 * h + mlp
    sliced = sequence_parallel and model.splits_sequence_with_tp
    whole = 0.0 if tp == 1 else GATHERED_INPUTS * h + (0.0 if sliced else RESIDUAL_STREAM * h)
    linear = s * b * (whole + (per_token - whole) / tp)
    scores = 0.0 if model.fused_attention else 5.0 * model.num_heads * s * model.seq_len * b / tp
    layer_input = 2.0 * s * b * h / (tp if sliced else 1)
    return np.select([recompute == 0, recompute == 1], [linear + scores, linear], layer_input)


def stage_param_counts(model: ModelSpec, stage_layers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(dense, expert) parameters held by each stage before TP/EP sharding; embedding on the first
    stage, LM head on the last (a head tied to the embedding is a copy of it there when they are apart)."""
    layers = np.asarray(stage_layers, dtype=np.float64)
    dense = layers * model.dense_layer_params
    dense[0] += model.embedding_params
    dense[-1] += model.output_params
    if model.tied_embeddings and len(layers) > 1:
        dense[-1] += model.vocab_size * model.hidden
    return dense, layers * model.expert_layer_params


def model_state_bytes(model: ModelSpec, stage_layers: np.ndarray, *, tp: int, dp: int, ep, zero) -> np.ndarray:
    """Weights + gradients + optimizer state per device, shape (rows, stages)."""
    dense, expert = stage_param_counts(model, stage_layers)
    ep = np.asarray(ep, dtype=np.float64)[:, None]
    zero = np.asarray(zero)[:, None]
    dense = dense[None, :] / tp
    expert = expert[None, :] / (tp * ep)
    expert_dp = dp / ep

    def sharded(stage: int) -> np.ndarray:
        on = zero >= stage
        return np.where(on, dense / dp, dense) + np.where(on, expert / expert_dp, expert)

    dtype = model.dtype_bytes
    states = dtype * sharded(3) + dtype * sharded(2) + optimizer_bytes_per_param(model) * sharded(1)
    gathered_layer = (model.dense_layer_params + model.expert_layer_params / ep) / tp
    outside = outside_layer_params(model, stage_layers)[None, :] / tp
    gathered = 2.0 * dtype * gathered_layer + (2.0 * dtype + 4.0) * outside
    return states + np.where(zero >= 3, gathered, 0.0)


def outside_layer_params(model: ModelSpec, stage_layers: np.ndarray) -> np.ndarray:
    """Parameters each stage holds outside its decoder layers: the embedding on the first, the head
    on the last (the embedding's copy there when tied and apart)."""
    dense, _ = stage_param_counts(model, stage_layers)
    return dense - np.asarray(stage_layers, dtype=np.float64) * model.dense_layer_params


def activation_bytes(model: ModelSpec, stage_layers: np.ndarray, *, tp: int, pp: int, micro_batch, recompute,
                     num_micro_batches, sequence_parallel: bool = True, cp=1) -> np.ndarray:
    """Peak activation bytes per device under 1F1B, shape (rows, stages); `cp` one degree or one per row."""
    layers = np.asarray(stage_layers, dtype=np.float64)[None, :]
    b = np.asarray(micro_batch, dtype=np.float64)[:, None]
    cp = np.asarray(cp, dtype=np.float64)[:, None] if np.ndim(cp) else cp
    recompute = np.asarray(recompute)[:, None]
    in_flight = np.minimum(pp - np.arange(pp)[None, :], np.asarray(num_micro_batches)[:, None])
    per_layer = activation_bytes_per_layer(model, b, recompute, tp, sequence_parallel, cp)
    # Full recomputation re-materializes one layer at a time during backward.
    working = np.where(recompute == 2,
                       activation_bytes_per_layer(model, b, np.zeros_like(recompute), tp, sequence_parallel, cp), 0.0)
    stored = in_flight * layers * per_layer + working + context_parallel_working_bytes(model, b, tp, cp)
    return stored + logit_bytes(model, pp) * b / cp


def context_parallel_working_bytes(model: ModelSpec, micro_batch, tp: int, cp: int) -> np.ndarray:
    """What one layer's attention holds while it runs under context parallelism, beyond what it keeps:
    the whole sequence's keys and values (all-gathered, or traded for heads) and, in backward, their
    gradients, for the TP rank's key-value heads. 0 without context parallelism."""
    whole = 2.0 * 4 * model.kv_dim * model.seq_len * np.asarray(micro_batch, dtype=np.float64) / tp
    return np.where(np.asarray(cp) > 1, whole, 0.0)


def logit_bytes(model: ModelSpec, pp: int) -> np.ndarray:
    """Bytes per sequence the loss holds on each stage, shape (1, pp): the last stage's logits."""
    logits = np.zeros((1, pp))
    logits[0, -1] = LOGIT_BYTES * model.seq_len * model.vocab_size
    return logits
