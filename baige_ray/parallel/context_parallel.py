"""Context parallelism: every sequence split over the `cp` ranks of a context-parallel group.

Each rank holds two of the sequence's 2 cp equal chunks, one from each end (rank r: chunks r and
2 cp - 1 - r), so that under a causal mask every rank attends to as many keys as the others (the
head-tail load balance of Megatron-LM and torchtitan). Everything outside attention is per token and
runs on the rank's own tokens: embeddings, norms, MLPs, the head and the loss (whose sum over the
group, normalised by the step's global count of trained tokens, is the one-process loss). Rotary
embeddings take each token's global position; labels are shifted before the split (the data's
targets already are).

Attention needs every earlier key of the token's document. Two ways to reach them:
- "ring": the keys and values are all-gathered over the group, and each rank attends its queries to the
  whole sequence tile by tile (parallel/block_attention.py: FlashAttention's algorithm, so neither the
  scores nor a (queries x keys) mask are ever whole). The gathered keys are not saved for backward: the
  backward gathers them again and sums their gradients back to their owners. Torch's ring attention
  rotates by all-gather too by default; passing blocks around the ring, so that even the transient
  keys of one layer stay at 1/cp and communication hides behind compute, is not built here.
- "ulysses": one all-to-all of queries, keys and values trades the sequence split for a head split
  (DeepSpeed-Ulysses): each rank attends its 1/cp of the heads over the whole sequence (SDPA's causal
  kernel, or tiles where documents or a sliding window mask it), and a second all-to-all trades back.
  The heads (and key-value heads, or they are repeated to the query heads) must divide by cp.

The communication is autograd-aware (its backward is the transposed exchange) and abortable by the
elastic controller like every collective a step waits on (parallel/distributed.py). The attention is
registered with transformers as an attention implementation that behaves as SDPA outside a
context-parallel forward (generation, DDP's settling pass), so a model's own attention modules, rotary
embeddings and projections run unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from baige_ray.parallel.block_attention import AttentionMask, BlockAttention, attention_backward, attention_forward
from baige_ray.parallel.distributed import PendingGather, all_to_all_abortable

ATTENTION_NAME = "baige_context_parallel"
SEQUENCE_DIM = 1  # (batch, sequence) token ids, targets and positions


@dataclass(frozen=True)
class SequenceShard:
    """Which tokens of a sequence context-parallel rank `rank` of `cp` holds: chunks rank and 2 cp - 1 - rank."""

    cp: int
    rank: int

    def check_length(self, length: int) -> None:
        if length % (2 * self.cp):
            raise ValueError(
                f"ParallelLayout.cp={self.cp} is invalid for sequences of {length} tokens: context parallelism "
                f"cuts each sequence into 2 x cp = {2 * self.cp} equal chunks; use a sequence length divisible by "
                f"{2 * self.cp}"
            )

    def indices(self, length: int) -> torch.Tensor:
        """The global indices of this rank's tokens, its head chunk then its tail chunk."""
        self.check_length(length)
        chunk = length // (2 * self.cp)
        head, tail = self.rank * chunk, (2 * self.cp - 1 - self.rank) * chunk
        return torch.cat([torch.arange(head, head + chunk), torch.arange(tail, tail + chunk)])

    def split(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of (batch, sequence, ...) `tensor`."""
        return tensor.index_select(SEQUENCE_DIM, self.indices(tensor.shape[SEQUENCE_DIM]).to(tensor.device))


@functools.lru_cache(maxsize=16)
def gathered_order(cp: int, length: int) -> torch.Tensor:
    """The global position of each token of a sequence gathered in rank order (rank 0's tokens, rank 1's, ...)."""
    return torch.cat([SequenceShard(cp, rank).indices(length) for rank in range(cp)])


@functools.lru_cache(maxsize=16)
def natural_order(cp: int, length: int) -> torch.Tensor:
    """For keys gathered in rank order: where each global position sits (the inverse of `gathered_order`)."""
    return torch.argsort(gathered_order(cp, length))


def document_ids(positions: torch.Tensor | None) -> torch.Tensor | None:
    """Each token's document within its packed sequence (positions restart at 0 for a new document)."""
    return None if positions is None else torch.cumsum(positions == 0, dim=SEQUENCE_DIM)


@dataclass(frozen=True)
class AttentionContext:
    """What a context-parallel forward's attention needs beyond its queries, keys and values."""

    group: dist.ProcessGroup
    shard: SequenceShard
    kind: str
    length: int  # the whole sequence's
    documents: torch.Tensor | None  # (batch, length) document ids of the whole sequence, None: one document


_active: contextvars.ContextVar[AttentionContext | None] = contextvars.ContextVar("context_parallel", default=None)


class SentBytes:
    """Bytes this process sent to its context-parallel peers since the last `take`: an all-gather sends
    the rank's tensor to each of the cp - 1 others (as a ring passes it on), an all-to-all the cp - 1
    pieces that are not its own."""

    def __init__(self) -> None:
        self._bytes = 0

    def all_gather(self, tensor: torch.Tensor, ranks: int) -> None:
        self._bytes += tensor.numel() * tensor.element_size() * (ranks - 1)

    def all_to_all(self, pieces: torch.Tensor) -> None:
        ranks = pieces.shape[0]
        self._bytes += pieces.numel() * pieces.element_size() * (ranks - 1) // ranks

    def take(self) -> int:
        sent, self._bytes = self._bytes, 0
        return sent


SENT = SentBytes()


def active() -> AttentionContext | None:
    return _active.get()


class ContextParallel:
    """One rank's context parallelism: the split of its inputs and the attention context of its forwards."""

    def __init__(self, group: dist.ProcessGroup, cp: int, rank: int, kind: str):
        self.group, self.kind = group, kind
        self.shard = SequenceShard(cp, rank)
        register_attention()

    def split(self, *tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
        return [None if tensor is None else self.shard.split(tensor) for tensor in tensors]

    @contextlib.contextmanager
    def attending(self, length: int, positions: torch.Tensor | None) -> Iterator[None]:
        """Forwards inside attend across the group to sequences of `length` tokens (`positions`: the
        whole sequences', where they pack several documents)."""
        self.shard.check_length(length)
        token = _active.set(AttentionContext(self.group, self.shard, self.kind, length, document_ids(positions)))
        try:
            yield
        finally:
            _active.reset(token)


def global_positions(positions: torch.Tensor | None, batch: int, length: int, device: torch.device) -> torch.Tensor:
    """Each token's position for the rotary embeddings: in its document where given, else 0..length-1."""
    if positions is not None:
        return positions
    return torch.arange(length, device=device).expand(batch, length)


# ---- communication with autograd ------------------------------------------------------------------------


class _AllToAll(torch.autograd.Function):
    """`tensor[j]` to rank j, received in sender order; backward sends each gradient back the same way."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        SENT.all_to_all(tensor)
        return all_to_all_abortable(tensor, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        SENT.all_to_all(grad)
        return all_to_all_abortable(grad, ctx.group), None


# ---- attention ------------------------------------------------------------------------------------------


def _key_chunks(cp: int, length: int) -> tuple[int, ...]:
    """Where the 2 cp chunks start: tiles never straddle two ranks' chunks, so causal tiles stay whole or empty."""
    chunk = length // (2 * cp)
    return tuple(range(chunk, length, chunk))


class _GatheredKeyAttention(torch.autograd.Function):
    """A rank's queries against the whole sequence's keys and values, all-gathered over the CP group in
    the forward and again in the backward (never saved: a layer holds only its own 1/cp of them), the
    gradients of the other ranks' keys and values summed back to their owners (a reduce-scatter, by
    all-to-all: gloo has none). Keys and values travel together, one collective each way.

    The exchange overlaps attention: while the gather runs (on the process group's own thread), the rank
    attends to its own keys; the other ranks' keys come after, and the two parts merge by their
    log-sum-exp. The backward does the same, from the merged output and log-sum-exp."""

    @staticmethod
    def forward(ctx, query, key, value, context: AttentionContext, mask: AttentionMask, scale: float):
        with torch.autocast(query.device.type, enabled=False):
            pending = _start_gather(torch.stack([key, value]), context)
            parts = _KeyParts(context, mask)
            own = attention_forward(query, key, value, parts.own_mask, scale, _query_cuts(query), parts.own_cuts)
            others_keys, others_values = parts.others(pending.result())
            others = attention_forward(query, others_keys, others_values, parts.others_mask, scale,
                                       _query_cuts(query), parts.others_cuts)
            out, lse = _merge(own, others)
        out = out.to(query.dtype)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.arguments = (context, mask, scale)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        context, mask, scale = ctx.arguments
        with torch.autocast(query.device.type, enabled=False):
            pending = _start_gather(torch.stack([key, value]), context)
            parts = _KeyParts(context, mask)
            d_q, d_k, d_v = attention_backward(grad_out, query, key, value, out, lse, parts.own_mask, scale,
                                               _query_cuts(query), parts.own_cuts)
            others_keys, others_values = parts.others(pending.result())
            d_q_others, d_others_keys, d_others_values = attention_backward(
                grad_out, query, others_keys, others_values, out, lse, parts.others_mask, scale,
                _query_cuts(query), parts.others_cuts)
            d_kv = _scatter_to_owners(torch.stack([d_k, d_v]), torch.stack([d_others_keys, d_others_values]), context)
        d_k, d_v = d_kv.unbind(0)
        return (d_q + d_q_others).to(query.dtype), d_k.to(key.dtype), d_v.to(value.dtype), None, None, None


class _KeyParts:
    """A rank's keys in two parts: its own chunks, and the other ranks' (gathered, in rank order), each with
    its global positions and the tile cuts that keep every tile inside one chunk."""

    def __init__(self, context: AttentionContext, mask: AttentionMask):
        cp, length, rank = context.shard.cp, context.length, context.shard.rank
        self.cp, self.rank, self.chunk = cp, rank, length // (2 * cp)
        by_rank = gathered_order(cp, length).to(mask.query_index.device).view(cp, -1)  # each rank's positions
        others = torch.cat([by_rank[r] for r in range(cp) if r != rank])
        self.own_mask = AttentionMask(mask.query_index, by_rank[rank], mask.documents, mask.sliding_window)
        self.others_mask = AttentionMask(mask.query_index, others, mask.documents, mask.sliding_window)
        self.own_cuts = (self.chunk,)
        self.others_cuts = tuple(range(self.chunk, len(others), self.chunk))

    def others(self, gathered: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of the other ranks from the gathered (cp, 2, batch, kv heads, local, dim)."""
        rest = torch.cat([gathered[r] for r in range(self.cp) if r != self.rank], dim=-2)
        return rest[0], rest[1]


def _merge(first: tuple[torch.Tensor, torch.Tensor], second: tuple[torch.Tensor, torch.Tensor]):
    """Attention over two disjoint key sets, each (output (batch, heads, queries, dim), log-sum-exp (batch,
    kv heads, group, queries)), as over their union. A query that sees no key of one set has lse -inf there."""
    (out_a, lse_a), (out_b, lse_b) = first, second
    lse = torch.logaddexp(lse_a, lse_b)
    finite = torch.isfinite(lse)
    safe = torch.where(finite, lse, torch.zeros_like(lse))
    weight_a = torch.where(finite, torch.exp(lse_a - safe), torch.zeros_like(lse)).flatten(1, 2)[..., None]
    weight_b = torch.where(finite, torch.exp(lse_b - safe), torch.zeros_like(lse)).flatten(1, 2)[..., None]
    return out_a * weight_a + out_b * weight_b, lse


def _query_cuts(query: torch.Tensor) -> tuple[int, ...]:
    return (query.shape[2] // 2,)  # the rank's head chunk, then its tail chunk


def _start_gather(tensor: torch.Tensor, context: AttentionContext) -> PendingGather:
    """Every rank's (..., local, d) `tensor`, gathered while the caller computes."""
    SENT.all_gather(tensor, context.shard.cp)
    return PendingGather(tensor, context.group)


def _scatter_to_owners(own: torch.Tensor, others: torch.Tensor, context: AttentionContext) -> torch.Tensor:
    """The gradient of this rank's (..., local, d) keys: its own `own` plus what every other rank computed
    for them; `others` is this rank's for the other ranks' keys, in rank order (as `_KeyParts.others`)."""
    cp, rank = context.shard.cp, context.shard.rank
    pieces = list(others.chunk(cp - 1, dim=-2))
    pieces.insert(rank, own)
    pieces = torch.stack(pieces)
    SENT.all_to_all(pieces)
    return all_to_all_abortable(pieces, context.group).sum(dim=0)


def _gathered_key_attention(context: AttentionContext, query, key, value, *, scaling, sliding_window):
    """Queries (batch, heads, local, dim) against the whole sequence's keys, all-gathered ("ring")."""
    mask = AttentionMask(context.shard.indices(context.length).to(query.device),
                         torch.arange(context.length, device=query.device), context.documents, sliding_window)
    return _GatheredKeyAttention.apply(query, key, value, context, mask, scaling)


def _ulysses_attention(context: AttentionContext, query, key, value, *, scaling, sliding_window):
    """Heads traded for sequence by all-to-all, attention over the whole sequence, traded back ("ulysses")."""
    cp, length = context.shard.cp, context.length
    heads = query.shape[1]
    if heads % cp:
        raise ValueError(f"ParallelLayout.cp={cp} with cp_kind='ulysses' needs attention heads divisible by cp: "
                         f"this rank computes {heads}; use cp_kind='ring' or a cp dividing {heads}")
    if key.shape[1] % cp:  # too few key-value heads to split: repeat them to the query heads
        key, value = (t.repeat_interleave(heads // key.shape[1], dim=1) for t in (key, value))
    order, inverse = natural_order(cp, length).to(query.device), gathered_order(cp, length).to(query.device)

    def to_heads(*tensors: torch.Tensor) -> list[torch.Tensor]:
        """(b, h_i, local, d) each -> (b, h_i / cp, length, d) in order, in one all-to-all."""
        b, _, local, d = tensors[0].shape
        widths = [t.shape[1] // cp for t in tensors]
        outgoing = torch.cat([t.reshape(b, cp, t.shape[1] // cp, local, d) for t in tensors], dim=2).transpose(0, 1)
        received = _AllToAll.apply(outgoing, context.group)  # (cp senders, b, sum h_i / cp, local, d)
        whole = torch.cat(received.unbind(0), dim=2).index_select(2, order)
        return list(whole.split(widths, dim=1))

    def to_sequence(tensor: torch.Tensor) -> torch.Tensor:  # the inverse of to_heads
        b, h, _, d = tensor.shape
        pieces = tensor.index_select(2, inverse).reshape(b, h, cp, length // cp, d).permute(2, 0, 1, 3, 4)
        received = _AllToAll.apply(pieces, context.group)  # (cp senders: their heads, b, h / cp, local, d)
        return received.transpose(0, 1).reshape(b, cp * h, length // cp, d)

    q, k, v = to_heads(query, key, value)
    if context.documents is None and sliding_window is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling,
                                             enable_gqa=k.shape[1] != q.shape[1])
    else:  # SDPA would save a whole (length x length) mask: tiles instead
        positions = torch.arange(length, device=query.device)
        mask = AttentionMask(positions, positions, context.documents, sliding_window)
        chunks = _key_chunks(cp, length)
        out = BlockAttention.apply(q, k, v, mask, scaling, chunks, chunks)
    return to_sequence(out)


def context_parallel_attention(module, query, key, value, attention_mask, *, scaling=None, dropout=0.0,
                               sliding_window=None, **kwargs):
    """transformers' attention-function signature: (batch, heads, tokens, dim) in, (batch, tokens, heads,
    dim) out, no weights. Outside a context-parallel forward, SDPA as transformers runs it."""
    context = _active.get()
    if context is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      sliding_window=sliding_window, **kwargs)
    if dropout:
        raise ValueError(f"attention dropout {dropout} is not supported under context parallelism: expected the "
                         "model's attention_dropout=0.0 (as pre-trained causal LMs ship it)")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    attend = _ulysses_attention if context.kind == "ulysses" else _gathered_key_attention
    out = attend(context, query, key, value, scaling=scaling, sliding_window=sliding_window)
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    """Make ATTENTION_NAME an attention implementation transformers' models can be set to."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, context_parallel_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)  # outside a CP forward, SDPA's masks
