"""Context parallelism: every sequence split over the `cp` ranks of a context-parallel group.

Each rank holds two of the sequence's 2 cp equal chunks, one from each end (rank r: chunks r and
2 cp - 1 - r), so that under a causal mask every rank attends to as many keys as the others (the
head-tail load balance of Megatron-LM and torchtitan). Everything outside attention is per token and
runs on the rank's own tokens: embeddings, norms, MLPs, the head and the loss (whose sum over the
group, normalised by the step's global count of trained tokens, is the one-process loss). Rotary
embeddings take each token's global position; labels are shifted before the split (the data's
targets already are).

Attention needs every earlier key of the token's document. Two ways to reach them:
- "ring": the keys and values are all-gathered over the group and each rank attends its queries to
  the whole sequence in one masked kernel call. Torch's ring attention rotates by all-gather too by
  default; passing blocks around the ring with a log-sum-exp merge (less key memory, communication
  behind compute) is not built here.
- "ulysses": an all-to-all trades the sequence split for a head split (DeepSpeed-Ulysses): each rank
  attends its 1/cp of the heads over the whole sequence, and a second all-to-all trades back. The heads
  (and key-value heads, or they are repeated to the query heads) must divide by cp.

The communication is autograd-aware (its backward is the transposed exchange) and abortable by the
elastic controller like every collective a step waits on (parallel/distributed.py). The attention is
registered with transformers as an attention implementation that behaves as SDPA outside a
context-parallel forward (generation, DDP's settling pass), so a model's own attention modules, rotary
embeddings and projections run unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from baige_ray.parallel.distributed import all_gather_abortable, all_to_all_abortable

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


def natural_order(cp: int, length: int) -> torch.Tensor:
    """For keys gathered in rank order (rank 0's tokens, rank 1's, ...): where each global position sits."""
    gathered = torch.cat([SequenceShard(cp, rank).indices(length) for rank in range(cp)])
    return torch.argsort(gathered)


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


class _AllGather(torch.autograd.Function):
    """Every rank's tensor stacked on a new first dimension; backward: each rank gets the sum of the
    gradients all ranks computed for its tensor (a reduce-scatter, by all-to-all: gloo has none)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return all_gather_abortable(tensor, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_to_all_abortable(grad, ctx.group).sum(dim=0), None


class _AllToAll(torch.autograd.Function):
    """`tensor[j]` to rank j, received in sender order; backward sends each gradient back the same way."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return all_to_all_abortable(tensor, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_to_all_abortable(grad, ctx.group), None


# ---- attention ------------------------------------------------------------------------------------------


def _mask(query_index: torch.Tensor, key_index: torch.Tensor, documents: torch.Tensor | None,
          sliding_window: int | None) -> torch.Tensor:
    """(batch or 1, 1, queries, keys) True where a query attends to a key: an earlier or equal position, in
    its own document, within the window (transformers' rule: query - key < window)."""
    allowed = key_index[None, :] <= query_index[:, None]
    if sliding_window is not None:
        allowed = allowed & (query_index[:, None] - key_index[None, :] < sliding_window)
    allowed = allowed[None, None]
    if documents is not None:
        same = documents[:, query_index, None] == documents[:, None, key_index]
        allowed = allowed & same[:, None]
    return allowed


def _gathered_key_attention(context: AttentionContext, query, key, value, *, scaling, dropout, sliding_window):
    """Queries (batch, heads, local, dim) against the whole sequence's keys, all-gathered ("ring")."""
    cp, length = context.shard.cp, context.length
    order = natural_order(cp, length).to(key.device)

    def whole(tensor: torch.Tensor) -> torch.Tensor:  # (cp, b, h, local, d) -> (b, h, length, d) in order
        gathered = _AllGather.apply(tensor, context.group)
        return torch.cat(gathered.unbind(0), dim=2).index_select(2, order)

    query_index = context.shard.indices(length).to(query.device)
    mask = _mask(query_index, torch.arange(length, device=query.device), context.documents, sliding_window)
    return F.scaled_dot_product_attention(query, whole(key), whole(value), attn_mask=mask, dropout_p=dropout,
                                          scale=scaling, enable_gqa=key.shape[1] != query.shape[1])


def _ulysses_attention(context: AttentionContext, query, key, value, *, scaling, dropout, sliding_window):
    """Heads traded for sequence by all-to-all, attention over the whole sequence, traded back ("ulysses")."""
    cp, length = context.shard.cp, context.length
    heads = query.shape[1]
    if heads % cp:
        raise ValueError(f"ParallelLayout.cp={cp} with cp_kind='ulysses' needs attention heads divisible by cp: "
                         f"this rank computes {heads}; use cp_kind='ring' or a cp dividing {heads}")
    if key.shape[1] % cp:  # too few key-value heads to split: repeat them to the query heads
        key, value = (t.repeat_interleave(heads // key.shape[1], dim=1) for t in (key, value))
    order = natural_order(cp, length).to(query.device)
    inverse = torch.argsort(order)

    def to_heads(tensor: torch.Tensor) -> torch.Tensor:  # (b, h, local, d) -> (b, h / cp, length, d) in order
        b, h, local, d = tensor.shape
        outgoing = tensor.reshape(b, cp, h // cp, local, d).transpose(0, 1)
        received = _AllToAll.apply(outgoing, context.group)  # (cp senders, b, h / cp, local, d)
        return torch.cat(received.unbind(0), dim=2).index_select(2, order)

    def to_sequence(tensor: torch.Tensor) -> torch.Tensor:  # the inverse of to_heads
        b, h, _, d = tensor.shape
        pieces = tensor.index_select(2, inverse).reshape(b, h, cp, length // cp, d).permute(2, 0, 1, 3, 4)
        received = _AllToAll.apply(pieces, context.group)  # (cp senders: their heads, b, h / cp, local, d)
        return received.transpose(0, 1).reshape(b, cp * h, length // cp, d)

    q, k, v = to_heads(query), to_heads(key), to_heads(value)
    gqa = k.shape[1] != q.shape[1]
    if context.documents is None and sliding_window is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, scale=scaling,
                                             enable_gqa=gqa)
    else:
        positions = torch.arange(length, device=query.device)
        mask = _mask(positions, positions, context.documents, sliding_window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=gqa)
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
    attend = _ulysses_attention if context.kind == "ulysses" else _gathered_key_attention
    out = attend(context, query, key, value, scaling=scaling, dropout=dropout, sliding_window=sliding_window)
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    """Make ATTENTION_NAME an attention implementation transformers' models can be set to."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, context_parallel_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)  # outside a CP forward, SDPA's masks
