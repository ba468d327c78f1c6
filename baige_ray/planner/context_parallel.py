"""What context parallelism moves per layer, as parallel/context_parallel.py runs it.

Bytes one rank sends per layer and micro-batch, forward and backward together, counting an all-gather
as the rank's tensor sent to each of the cp - 1 others (a ring's traffic) and an all-to-all as the
cp - 1 pieces that are not the rank's own:
- ring: keys and values all-gathered in the forward and again in the backward (they are not kept),
  and their fp32 gradients returned to their owners by all-to-all;
- ulysses: queries, keys and values traded for heads and the output traded back, in the forward, and
  their gradients the other way in the backward; keys and values repeated to the query heads first
  where their heads do not divide by cp.
"""

from __future__ import annotations

from baige_ray.planner.model_spec import ModelSpec

GRADIENT_BYTES = 4  # the tiled attention's key and value gradients are summed in fp32


def context_parallel_bytes_per_layer(model: ModelSpec, *, cp: int, kind: str, micro_batch: int, tp: int = 1,
                                     dtype_bytes: int | None = None) -> float:
    """Bytes a rank sends per layer for one micro-batch of `micro_batch` sequences (forward + backward);
    `dtype_bytes`: the activations' (default the model's)."""
    if cp == 1:
        return 0.0
    dtype = dtype_bytes or model.dtype_bytes
    local_tokens = micro_batch * model.seq_len / cp
    kv_heads, heads, head_dim = max(1, model.kv_heads // tp), model.num_heads // tp, model.head_size
    if kind == "ring":
        keys_and_values = 2 * kv_heads * head_dim * local_tokens
        gathers = 2 * keys_and_values * dtype * (cp - 1)
        return gathers + keys_and_values * cp * GRADIENT_BYTES * (cp - 1) / cp
    if kind == "ulysses":
        if kv_heads % cp:
            kv_heads = heads
        exchanged = (2 * heads + 2 * kv_heads) * head_dim * local_tokens * dtype
        return 2 * exchanged * (cp - 1) / cp
    raise ValueError(f"kind={kind!r} is invalid: expected 'ring' or 'ulysses'")
