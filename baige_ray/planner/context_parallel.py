"""What context parallelism moves per layer, as parallel/context_parallel.py runs it, and how long it takes.

Per layer and micro-batch, forward and backward together, on a CP group of `cp` ranks:
- ring: keys and values all-gathered together in the forward and again in the backward (they are not
  kept), and their fp32 gradients summed back to their owners by one all-to-all;
- ulysses: queries, keys and values traded for heads in one all-to-all and the output traded back in
  another, in the forward, and their gradients the other way in the backward; keys and values repeated
  to the query heads first where their heads do not divide by cp.
Bytes sent count an all-gather as the rank's tensor sent to each of the cp - 1 others (a ring's traffic)
and an all-to-all as the cp - 1 pieces that are not the rank's own.

What overlaps: the ring's two all-gathers run while the rank attends to its own keys (forward, then
backward), so only what outlasts that attention adds to the layer's time (`CPExchangeSeconds.exposed`);
the gradients' all-to-all, and every Ulysses exchange, wait for the attention that needs them or comes
after them, so their whole time adds.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class CPExchangeSeconds:
    """One layer's exchanges for a micro-batch, per row (rows, 1): the all-gather each pass (forward, then
    backward) runs beside the attention to the rank's own keys, and the exchanges nothing hides."""

    gather: np.ndarray
    waiting: np.ndarray

    def exposed(self, own_attention_forward: np.ndarray) -> np.ndarray:
        """Seconds added to the layer, given the forward attention to the rank's own keys (the backward's
        is twice that)."""
        forward = np.maximum(self.gather - own_attention_forward, 0.0)
        backward = np.maximum(self.gather - 2 * own_attention_forward, 0.0)
        return forward + backward + self.waiting


def layer_seconds(model: ModelSpec, *, cp, ulysses, micro_batch, tp: int,
                  links: dict[str, GroupLink]) -> CPExchangeSeconds:
    """Per row: one layer's exchanges for a micro-batch, each row's CP group on links[f"cp{n}"]."""
    cp = np.asarray(cp)
    ulysses = np.asarray(ulysses, dtype=bool)
    b = np.asarray(micro_batch, dtype=np.float64)
    gather, waiting = np.zeros(len(cp)), np.zeros(len(cp))
    for size in np.unique(cp[cp > 1]):
        link = links[f"cp{int(size)}"]
        ring, rows = (cp == size) & ~ulysses, (cp == size) & ulysses
        if ring.any():  # the same all-gather in each pass, then the gradients' all-to-all
            for collective, bytes_ in exchanges(model, cp=size, kind="ring", micro_batch=b[ring], tp=tp):
                seconds = reduce_scatter(size, bytes_, link, collective)
                if collective == "all_gather":
                    gather[ring] = seconds
                else:
                    waiting[ring] += seconds
        if rows.any():
            waiting[rows] = context_parallel_seconds(model, cp=size, kind="ulysses", micro_batch=b[rows], tp=tp,
                                                     link=link)
    return CPExchangeSeconds(gather[:, None], waiting[:, None])
