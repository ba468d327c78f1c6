"""What context parallelism moves per layer, as parallel/context_parallel.py runs it, and how long it takes.

Per layer and micro-batch, forward and backward together, on a CP group of `cp` ranks:
- ring: keys and values all-gathered together in the forward and again in the backward (they are not
  kept), and their fp32 gradients summed back to their owners by one all-to-all;
- ulysses: queries, keys and values traded for heads in one all-to-all and the output traded back in
  another, in the forward, and their gradients the other way in the backward; keys and values repeated
  to the query heads first where their heads do not divide by cp.
Bytes sent count an all-gather as the rank's tensor sent to each of the cp - 1 others (a ring's traffic)
and an all-to-all as the cp - 1 pieces that are not the rank's own. The exchanges wait for the attention
that needs them (nothing overlaps them in the engines), so their time adds to the layer's.
"""

from __future__ import annotations

import numpy as np

from baige_ray.planner.cost import reduce_scatter
from baige_ray.planner.links import GroupLink
from baige_ray.planner.model_spec import ModelSpec

GRADIENT_BYTES = 4  # the tiled attention's key and value gradients are summed in fp32
CP_KINDS = ("ring", "ulysses")


def exchanges(model: ModelSpec, *, cp, kind: str, micro_batch, tp: int = 1,
              dtype_bytes: int | None = None) -> list[tuple[str, np.ndarray]]:
    """(collective, bytes of the whole exchanged tensor) per layer and micro-batch; `cp` and `micro_batch`
    may be arrays (one per row)."""
    dtype = dtype_bytes or model.dtype_bytes
    cp = np.asarray(cp, dtype=np.float64)
    tokens = np.asarray(micro_batch, dtype=np.float64) * model.seq_len  # the whole sequences'
    kv_heads, heads, head_dim = max(1, model.kv_heads // tp), model.num_heads // tp, model.head_size
    if kind == "ring":
        keys_and_values = 2 * kv_heads * head_dim * tokens
        return [("all_gather", keys_and_values * dtype), ("all_gather", keys_and_values * dtype),
                ("all_to_all", keys_and_values * GRADIENT_BYTES)]
    if kind == "ulysses":  # queries, keys and values in one all-to-all, the output in another; both ways back
        kv = np.where(kv_heads % cp == 0, kv_heads, heads)
        inputs, output = (heads + 2 * kv) * head_dim * tokens / cp * dtype, heads * head_dim * tokens / cp * dtype
        return [("all_to_all", inputs), ("all_to_all", output), ("all_to_all", output), ("all_to_all", inputs)]
    raise ValueError(f"kind={kind!r} is invalid: expected one of {CP_KINDS}")


def context_parallel_bytes_per_layer(model: ModelSpec, *, cp: int, kind: str, micro_batch, tp: int = 1,
                                     dtype_bytes: int | None = None) -> float:
    """Bytes a rank sends per layer for one micro-batch of `micro_batch` sequences (forward + backward)."""
    if cp == 1:
        return 0.0
    return float(sum((cp - 1) / cp * size for _, size in exchanges(model, cp=cp, kind=kind, micro_batch=micro_batch,
                                                                   tp=tp, dtype_bytes=dtype_bytes)))


def context_parallel_seconds(model: ModelSpec, *, cp, kind: str, micro_batch, tp: int, link: GroupLink) -> np.ndarray:
    """Seconds per layer and micro-batch of those exchanges on the CP group's worst link (0 at cp 1)."""
    total = np.zeros(np.broadcast(np.asarray(cp), np.asarray(micro_batch)).shape)
    for collective, size in exchanges(model, cp=cp, kind=kind, micro_batch=micro_batch, tp=tp):
        total = total + reduce_scatter(cp, size, link, collective)
    return np.where(np.asarray(cp) > 1, total, 0.0)


def layer_seconds(model: ModelSpec, *, cp, ulysses, micro_batch, tp: int, links: dict[str, GroupLink]) -> np.ndarray:
    """Per row, (rows, 1): one layer's exchanges for a micro-batch, each row's CP group on links[f"cp{n}"]."""
    cp = np.asarray(cp)
    ulysses = np.asarray(ulysses, dtype=bool)
    b = np.asarray(micro_batch, dtype=np.float64)
    seconds = np.zeros(len(cp))
    for size in np.unique(cp[cp > 1]):
        for kind, chosen in (("ring", ~ulysses), ("ulysses", ulysses)):
            rows = (cp == size) & chosen
            if rows.any():
                seconds[rows] = context_parallel_seconds(model, cp=size, kind=kind, micro_batch=b[rows], tp=tp,
                                                         link=links[f"cp{int(size)}"])
    return seconds[:, None]
