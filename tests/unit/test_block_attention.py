"""Attention by tiles equals SDPA with the whole mask, forward and backward, and saves no quadratic tensor."""

import pytest
import torch
import torch.nn.functional as F

import baige_ray.parallel.block_attention as block_attention
from baige_ray.bench.saved_activations import saved_activation_bytes
from baige_ray.parallel.block_attention import AttentionMask, BlockAttention


def _inputs(length: int, heads: int = 4, kv_heads: int = 2, dim: int = 8, batch: int = 2):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, length, dim, generator=generator, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(batch, kv_heads, length, dim, generator=generator, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    return q, k, v


def _whole_mask(length: int, documents, window):
    index = torch.arange(length)
    allowed = index[None, :] <= index[:, None]
    if window is not None:
        allowed = allowed & (index[:, None] - index[None, :] < window)
    allowed = allowed[None, None]
    if documents is not None:
        allowed = allowed & (documents[:, :, None] == documents[:, None, :])[:, None]
    return allowed


@pytest.mark.parametrize("documents, window", [(False, None), (True, None), (False, 5), (True, 7)])
def test_tiles_give_sdpa_outputs_and_gradients(monkeypatch, documents, window):
    monkeypatch.setattr(block_attention, "MAX_BLOCK", 6)  # several tiles, some straddling documents
    length = 24
    q, k, v = _inputs(length)
    ids = torch.tensor([[1] * 5 + [2] * 11 + [3] * 8, [1] * 24]) if documents else None
    index = torch.arange(length)
    out = BlockAttention.apply(q, k, v, AttentionMask(index, index, ids, window), 0.3, (12,), (12,))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=_whole_mask(length, ids, window), scale=0.3,
                                              enable_gqa=True)
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    actual = torch.autograd.grad(out, (q, k, v), grad)
    reference = torch.autograd.grad(expected, (q, k, v), grad)
    for mine, theirs in zip(actual, reference):
        torch.testing.assert_close(mine, theirs)


def test_queries_from_both_ends_see_the_keys_before_them():
    """A context-parallel rank's queries: the sequence's first and last quarters."""
    q_all, k, v = _inputs(16)
    rows = torch.cat([torch.arange(0, 4), torch.arange(12, 16)])
    q = q_all[:, :, rows].detach().requires_grad_()
    out = BlockAttention.apply(q, k, v, AttentionMask(rows, torch.arange(16)), 0.5, (4,), (4, 8, 12))
    expected = F.scaled_dot_product_attention(q_all, k, v, is_causal=True, scale=0.5, enable_gqa=True)[:, :, rows]
    torch.testing.assert_close(out, expected)


def test_only_linear_tensors_are_saved_for_backward():
    length = 512
    q, k, v = (t.detach().float().requires_grad_() for t in _inputs(length, batch=1))
    index = torch.arange(length)
    saved, _ = saved_activation_bytes(lambda: BlockAttention.apply(q, k, v, AttentionMask(index, index), 0.3, (), ()))
    linear = sum(t.numel() * 4 for t in (q, k, v)) + q.numel() * 4 + 4 * length * 4  # q k v, output, lse
    assert saved <= linear
