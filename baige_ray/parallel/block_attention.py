"""Causal attention computed block by block, keeping only what is linear in the sequence for backward.

Context parallelism needs attention of a rank's queries (two chunks of the sequence, from its two ends)
against keys that are not all its own, masked by global position, by document and by sliding window.
SDPA takes such a mask only as a whole (queries x keys) tensor, which its CPU kernel converts to floats
and saves for backward: memory quadratic in the sequence, the very thing context parallelism divides.
Here the scores exist one (query block x key block) tile at a time; the forward keeps each query's
log-sum-exp, the backward recomputes the tiles from it (FlashAttention's algorithm, in PyTorch
operations). Tiles that the mask empties are skipped, tiles it leaves whole are not masked.

Grouped-query attention by grouping the query heads over their key-value head (no repeated keys).
Scores, softmax and accumulations run in fp32 at least, whatever the inputs' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_BLOCK = 1024  # tokens per tile side: a tile's scores are heads x MAX_BLOCK^2 fp32 at most


@dataclass(frozen=True)
class AttentionMask:
    """Which keys each query sees: an earlier or equal global position, in its own document (where
    `documents`, (batch, length) ids by global position, is given), within `sliding_window` (transformers'
    rule: query - key < window)."""

    query_index: torch.Tensor  # (queries,) global positions of the queries
    key_index: torch.Tensor  # (keys,) global positions of the keys
    documents: torch.Tensor | None = None
    sliding_window: int | None = None

    def tile(self, queries: slice, keys: slice) -> torch.Tensor | None | bool:
        """False: no query of the tile sees a key of it; None: every one sees every one; else the
        (batch or 1, 1, 1, tile queries, tile keys) boolean mask."""
        q, k = self.query_index[queries], self.key_index[keys]
        q_first, q_last, k_first, k_last = int(q.min()), int(q.max()), int(k.min()), int(k.max())
        if k_first > q_last:
            return False
        window = self.sliding_window
        if window is not None and q_first - k_last >= window:
            return False
        if self.documents is None and k_last <= q_first and (window is None or q_last - k_first < window):
            return None
        allowed = k[None, :] <= q[:, None]
        if window is not None:
            allowed = allowed & (q[:, None] - k[None, :] < window)
        allowed = allowed[None]
        if self.documents is not None:
            allowed = allowed & (self.documents[:, q, None] == self.documents[:, None, k])
        if not bool(allowed.any()):
            return False
        return allowed[:, None, None]


def _blocks(length: int, boundaries: tuple[int, ...] = ()) -> list[slice]:
    """Slices of at most MAX_BLOCK covering 0..length, cut at every one of `boundaries` too."""
    cuts = sorted({0, length, *boundaries})
    blocks = []
    for start, end in zip(cuts, cuts[1:]):
        blocks += [slice(at, min(at + MAX_BLOCK, end)) for at in range(start, end, MAX_BLOCK)]
    return blocks


def _grouped(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(batch, heads, queries, dim) as (batch, kv heads, group, queries, dim): query head h uses kv head h // group."""
    b, h, n, d = query.shape
    return query.reshape(b, kv_heads, h // kv_heads, n, d)


def _compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    return torch.promote_types(tensor.dtype, torch.float32)  # fp32 for bf16 inputs, fp64 stays fp64


def _scores(query: torch.Tensor, key: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    scores = torch.matmul(query, key.unsqueeze(2).transpose(-1, -2)) * scale
    return scores if mask is None else scores.masked_fill(~mask, float("-inf"))


def attention_forward(query, key, value, mask: AttentionMask, scale: float, query_cuts=(), key_cuts=()):
    """(output (batch, heads, queries, dim), log-sum-exp (batch, kv heads, group, queries)), both in fp32 or wider, of
    `query` against `key` and `value` (batch, kv heads, keys, dim)."""
    dtype = _compute_dtype(query)
    q = _grouped(query.to(dtype), key.shape[1])
    k, v = key.to(dtype), value.to(dtype)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), device=q.device, dtype=dtype)
    key_blocks = _blocks(k.shape[2], key_cuts)
    for rows in _blocks(q.shape[3], query_cuts):
        q_block = q[..., rows, :]
        running_max = torch.full(q_block.shape[:-1], float("-inf"), device=q.device, dtype=dtype)
        total = torch.zeros_like(running_max)
        acc = torch.zeros_like(q_block)
        for cols in key_blocks:
            tile = mask.tile(rows, cols)
            if tile is False:
                continue
            scores = _scores(q_block, k[:, :, cols], scale, tile)
            new_max = torch.maximum(running_max, scores.amax(dim=-1))
            safe_max = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
            weights = torch.exp(scores - safe_max[..., None])
            rescale = torch.exp(running_max - safe_max)
            total = total * rescale + weights.sum(dim=-1)
            acc = acc * rescale[..., None] + torch.matmul(weights, v[:, :, cols].unsqueeze(2))
            running_max = new_max
        seen = total > 0
        out[..., rows, :] = torch.where(seen[..., None], acc / total.clamp_min(1e-30)[..., None], 0.0)
        lse[..., rows] = torch.where(seen, running_max + torch.log(total.clamp_min(1e-30)), float("-inf"))
    return out.flatten(1, 2), lse


def attention_backward(grad_out, query, key, value, out, lse, mask: AttentionMask, scale: float,
                       query_cuts=(), key_cuts=()):
    """Gradients (fp32 or wider) of query, key and value from the forward's output and log-sum-exp."""
    kv_heads, dtype = key.shape[1], _compute_dtype(query)
    q, k, v = _grouped(query.to(dtype), kv_heads), key.to(dtype), value.to(dtype)
    d_out, o = _grouped(grad_out.to(dtype), kv_heads), _grouped(out.to(dtype), kv_heads)
    d_q, d_k, d_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    key_blocks = _blocks(k.shape[2], key_cuts)
    for rows in _blocks(q.shape[3], query_cuts):
        q_block, d_out_block = q[..., rows, :], d_out[..., rows, :]
        row_lse = lse[..., rows]
        row_lse = torch.where(torch.isfinite(row_lse), row_lse, torch.zeros_like(row_lse))
        delta = (d_out_block * o[..., rows, :]).sum(dim=-1, keepdim=True)
        for cols in key_blocks:
            tile = mask.tile(rows, cols)
            if tile is False:
                continue
            k_block, v_block = k[:, :, cols].unsqueeze(2), v[:, :, cols].unsqueeze(2)
            weights = torch.exp(_scores(q_block, k[:, :, cols], scale, tile) - row_lse[..., None])
            d_v[:, :, cols] += torch.matmul(weights.transpose(-1, -2), d_out_block).sum(dim=2)
            d_scores = weights * (torch.matmul(d_out_block, v_block.transpose(-1, -2)) - delta) * scale
            d_q[..., rows, :] += torch.matmul(d_scores, k_block)
            d_k[:, :, cols] += torch.matmul(d_scores.transpose(-1, -2), q_block).sum(dim=2)
    return d_q.flatten(1, 2), d_k, d_v


class BlockAttention(torch.autograd.Function):
    """Causal attention by tiles (module docstring): saves query, key, value, output and log-sum-exp."""

    @staticmethod
    def forward(ctx, query, key, value, mask: AttentionMask, scale: float, query_cuts: tuple, key_cuts: tuple):
        with torch.autocast(query.device.type, enabled=False):
            out, lse = attention_forward(query, key, value, mask, scale, query_cuts, key_cuts)
        out = out.to(query.dtype)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.arguments = (mask, scale, query_cuts, key_cuts)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        with torch.autocast(query.device.type, enabled=False):
            d_q, d_k, d_v = attention_backward(grad_out, query, key, value, out, lse, *ctx.arguments)
        return d_q.to(query.dtype), d_k.to(key.dtype), d_v.to(value.dtype), None, None, None, None
