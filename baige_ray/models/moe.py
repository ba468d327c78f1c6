"""A top-k routed mixture-of-experts MLP with expert parallelism.

Router: a linear map to one logit per expert, softmax in float32, the top k experts per token,
their probabilities renormalized to sum to 1 (Mixtral's gating). No capacity limit: every token
reaches all k of its experts, whatever the load.

Load balancing: DeepSeek-V3's sequence-wise auxiliary loss, coef x mean over sequences of
sum_e f_e P_e, with f_e the share of the sequence's routed slots that went to expert e (x E / k)
and P_e the mean router probability of e over the sequence. Being a mean over sequences, it
decomposes over any split of the batch, so data- and expert-parallel runs optimize exactly the
objective of one process holding the whole batch.

Experts are grouped tensors indexed by expert (`experts.up`: E x hidden x ffn, `experts.down`:
E x ffn x hidden), which is their canonical form. Expert parallelism shards them by expert index
(a DTensor `Shard(0)` over the expert-parallel mesh: snapshots gather and restores re-cut them
for any EP degree) and moves tokens to their experts' ranks and back with two uneven
`all_to_all_single`s per layer forward (two more in backward). Optional shared experts are a
dense MLP every token passes through beside the routed ones.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from baige_ray.api.validation import require_int, require_number
from baige_ray.models.aux_loss import attach_auxiliary_loss
from baige_ray.parallel.boxes import is_dtensor


@dataclass(kw_only=True, frozen=True)
class MoEConfig:
    """Experts of each MoE layer; `num_dense_layers` first blocks keep a dense MLP (DeepSeek-V3 style)."""

    num_experts: int = 8
    top_k: int = 2
    expert_ffn_hidden: int | None = None  # None: as wide as the model's dense MLP
    num_shared_experts: int = 0
    aux_loss_coef: float = 0.01
    num_dense_layers: int = 0
    # Under expert parallelism, compute the shared experts while the tokens travel to their routed experts.
    # Off by default: on gloo over 2 CPU cores the collective's thread competes with that compute
    # (bench moe: 0.87x to 1.07x over four runs, no gain beyond noise); with NCCL the transfer runs
    # beside it on the device.
    overlap_shared_experts: bool = False
    # Under expert parallelism, split each layer's tokens into this many chunks and pipeline them: one
    # chunk's dispatch and combine all-to-alls are in flight while another chunk's experts compute.
    # 1 by default: on gloo over 2 CPU cores, 2 chunks ran at 0.67x to 0.82x of plain EP (bench moe,
    # three runs): twice the collectives, each paying its latency, and no idle core to hide them.
    dispatch_chunks: int = 1

    def __post_init__(self) -> None:
        require_int("MoEConfig", "num_experts", self.num_experts, minimum=1)
        require_int("MoEConfig", "top_k", self.top_k, minimum=1)
        if self.top_k > self.num_experts:
            raise ValueError(
                f"MoEConfig.top_k={self.top_k} is invalid: expected at most num_experts={self.num_experts}"
            )
        if self.expert_ffn_hidden is not None:
            require_int("MoEConfig", "expert_ffn_hidden", self.expert_ffn_hidden, minimum=1)
        require_int("MoEConfig", "num_shared_experts", self.num_shared_experts, minimum=0)
        require_number("MoEConfig", "aux_loss_coef", self.aux_loss_coef, minimum=0)
        require_int("MoEConfig", "num_dense_layers", self.num_dense_layers, minimum=0)
        require_int("MoEConfig", "dispatch_chunks", self.dispatch_chunks, minimum=1)

    def check_expert_parallel(self, ep: int) -> None:
        if self.num_experts % ep:
            raise ValueError(
                f"ParallelLayout.ep={ep} is invalid: expected a divisor of MoEConfig.num_experts={self.num_experts}"
            )


class ExpertTraffic:
    """What one MoE layer routed on this rank since the last `take`: slots per expert of each forward
    (this rank's tokens, before dispatch) and seconds spent waiting in its all-to-alls."""

    def __init__(self) -> None:
        self.forward_counts: list[torch.Tensor] = []
        self.all_to_all_s = 0.0

    def count(self, counts: torch.Tensor) -> None:
        self.forward_counts.append(counts.detach())

    def take(self, last_forwards: int | None = None) -> tuple[torch.Tensor | None, float]:
        """(slots per expert summed over the last `last_forwards` forwards, None: all; seconds), and reset."""
        counted = self.forward_counts[-last_forwards:] if last_forwards else self.forward_counts
        taken = (torch.stack(counted).sum(dim=0) if counted else None, self.all_to_all_s)
        self.forward_counts, self.all_to_all_s = [], 0.0
        return taken


@dataclass(frozen=True)
class Routing:
    """Each token's top-k experts (T x k) and their gate weights (T x k), and the router's probabilities."""

    experts: torch.Tensor
    weights: torch.Tensor
    probabilities: torch.Tensor  # T x E, float32


class TopKRouter(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, num_experts, bias=False)

    def forward(self, tokens: torch.Tensor) -> Routing:
        probabilities = F.softmax(self.gate(tokens).float(), dim=-1)
        weights, experts = torch.topk(probabilities, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(experts=experts, weights=weights.to(tokens.dtype), probabilities=probabilities)


def sequence_balance_loss(routing: Routing, batch: int, num_experts: int, coef: float) -> torch.Tensor:
    """coef x mean over sequences of sum_e f_e P_e (f_e scaled so a uniform router scores 1)."""
    probabilities = routing.probabilities.view(batch, -1, num_experts)
    experts = routing.experts.view(batch, -1)
    counts = torch.zeros(batch, num_experts, device=experts.device).scatter_add_(
        1, experts, torch.ones_like(experts, dtype=torch.float32))
    share = counts * num_experts / experts.shape[1]
    return coef * (share * probabilities.mean(dim=1)).sum(dim=-1).mean()


class GroupedExperts(nn.Module):
    """E two-layer GELU MLPs held as two tensors indexed by expert; a rank may hold a contiguous slice."""

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, *, residual_std: float):
        super().__init__()
        self.num_experts = num_experts
        self.up = nn.Parameter(torch.empty(num_experts, hidden, ffn_hidden).normal_(std=0.02))
        self.down = nn.Parameter(torch.empty(num_experts, ffn_hidden, hidden).normal_(std=residual_std))

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows of `tokens` grouped by local expert, `counts[e]` rows for the e-th expert held here."""
        return GeluExpertKernel()({"up": _local(self.up), "down": _local(self.down)}, tokens, counts)


class GeluExpertKernel:
    """The experts' computation on given weights (`up`, `down`: one row per expert held), so that a
    process holding only some experts' weights (an expert rank of expert-parallel serving) runs it."""

    def __call__(self, weights: dict[str, torch.Tensor], tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        up, down = weights["up"], weights["down"]
        # Empty chunks too: the output must stay in the autograd graph when no token came, or this rank
        # would skip the backward all-to-all its expert-parallel peers wait in.
        return torch.cat([F.gelu(chunk @ up[e]) @ down[e] for e, chunk in enumerate(tokens.split(counts))])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if is_dtensor(tensor) else tensor


class MoELayer(nn.Module):
    """Router, routed experts and optional shared experts; `enable_expert_parallel` shards the experts."""

    def __init__(self, hidden: int, dense_ffn_hidden: int, config: MoEConfig, *, num_layers: int):
        super().__init__()
        self.config = config
        ffn = config.expert_ffn_hidden or dense_ffn_hidden
        self.router = TopKRouter(hidden, config.num_experts, config.top_k)
        self.experts = GroupedExperts(hidden, ffn, config.num_experts,
                                      residual_std=0.02 / math.sqrt(2 * num_layers))
        self.shared = (SharedExperts(hidden, ffn * config.num_shared_experts) if config.num_shared_experts else None)
        self.expert_group: dist.ProcessGroup | None = None
        self.traffic = ExpertTraffic()
        self.expert_runner: LocalExperts | None = None  # set by expert-parallel serving: where slots go instead

    @property
    def num_experts(self) -> int:
        return self.config.num_experts

    def expert_weights(self) -> dict[str, torch.Tensor]:
        """The routed experts' tensors, whole and indexed by expert, as `expert_kernel` takes them."""
        return {"up": self.experts.up.detach(), "down": self.experts.down.detach()}

    def expert_kernel(self) -> GeluExpertKernel:
        return GeluExpertKernel()

    def run_experts_with(self, runner: LocalExperts | None) -> None:
        """Hand this layer's routed slots (grouped by expert) to `runner`; None: compute them here again."""
        self.expert_runner = runner

    def enable_expert_parallel(self, ep_mesh: DeviceMesh) -> None:
        """Keep only this rank's experts (a DTensor slice by expert index); route tokens over `ep_mesh`."""
        from torch.distributed.tensor import Shard, distribute_tensor

        self.config.check_expert_parallel(ep_mesh.size())
        for name in ("up", "down"):
            full = getattr(self.experts, name)
            sharded = distribute_tensor(full.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(self.experts, name, nn.Parameter(sharded))
        self.expert_group = ep_mesh.get_group()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        tokens = x.reshape(-1, hidden)
        routing = self.router(tokens)
        shared = (lambda: self.shared(tokens)) if self.shared is not None else None
        overlap = shared if self.expert_group is not None and self.config.overlap_shared_experts else None
        routed, shared_out = self._routed_experts(tokens, routing, alongside_dispatch=overlap)
        if shared is not None:
            routed = routed + (shared_out if overlap is not None else shared())
        out = routed.view(batch, seq, hidden)
        if torch.is_grad_enabled() and self.config.aux_loss_coef > 0:
            loss = sequence_balance_loss(routing, batch, self.num_experts, self.config.aux_loss_coef)
            out = attach_auxiliary_loss(out, loss)
        return out

    def _routed_experts(self, tokens: torch.Tensor, routing: Routing, *,
                        alongside_dispatch: Callable[[], torch.Tensor] | None = None) -> tuple[torch.Tensor, Any]:
        if self.expert_group is not None and self.config.dispatch_chunks > 1:
            routed = route_in_chunks(tokens, routing.experts, routing.weights, self.experts,
                                     num_experts=self.num_experts, group=self.expert_group, traffic=self.traffic,
                                     chunks=self.config.dispatch_chunks)
            return routed, alongside_dispatch() if alongside_dispatch is not None else None
        if self.expert_runner is not None:
            return route_to_experts(tokens, routing.experts, routing.weights, self.expert_runner,
                                    num_experts=self.num_experts, group=None, traffic=self.traffic)
        return route_to_experts(tokens, routing.experts, routing.weights, self.experts, num_experts=self.num_experts,
                                group=self.expert_group, traffic=self.traffic, alongside_dispatch=alongside_dispatch)


LocalExperts = Callable[[torch.Tensor, list[int]], torch.Tensor]
"""Runs the experts held here on rows grouped by local expert, `counts[e]` rows for the e-th."""


def route_to_experts(tokens: torch.Tensor, expert_index: torch.Tensor, gate_weights: torch.Tensor,
                     local_experts: LocalExperts, *, num_experts: int, group: dist.ProcessGroup | None,
                     traffic: ExpertTraffic,
                     alongside_dispatch: Callable[[], Any] | None = None) -> tuple[torch.Tensor, Any]:
    """Each token's gate-weighted sum of its k experts' outputs (`expert_index`, `gate_weights`: T x k),
    and what `alongside_dispatch` returned, run while the tokens travel to their experts' ranks.
    Without a group every expert is held here."""
    top_k = expert_index.shape[-1]
    slots, order, counts = _sorted_slots(tokens, expert_index, top_k, num_experts)
    token_of_slot = order // top_k
    traffic.count(counts)
    alongside = None
    if group is None:
        expert_out = local_experts(slots, counts.tolist())
    else:
        expert_out, alongside = exchange_with_experts(slots, counts, local_experts, num_experts, group, traffic,
                                                      alongside_dispatch)
    weighted = expert_out * gate_weights.reshape(-1)[order].unsqueeze(-1).to(expert_out.dtype)
    return torch.zeros_like(tokens).index_add_(0, token_of_slot, weighted.to(tokens.dtype)), alongside


def route_in_chunks(tokens: torch.Tensor, expert_index: torch.Tensor, gate_weights: torch.Tensor,
                    local_experts: LocalExperts, *, num_experts: int, group: dist.ProcessGroup,
                    traffic: ExpertTraffic, chunks: int) -> torch.Tensor:
    """`route_to_experts` over an expert-parallel group with the tokens split into `chunks` pipelined
    chunks: chunk c+1's dispatch and chunk c-1's combine travel while chunk c's experts compute.
    Every rank splits into the same number of chunks (some may be empty), so collectives pair up."""
    top_k = expert_index.shape[-1]
    parts = tokens.tensor_split(chunks)
    pieces = [_sorted_slots(part, experts, top_k, num_experts)
              for part, experts in zip(parts, expert_index.tensor_split(chunks))]
    traffic.count(torch.stack([counts for _, _, counts in pieces]).sum(dim=0))
    ranks = dist.get_world_size(group)
    local = num_experts // ranks
    sent = torch.stack([counts.view(ranks, local) for _, _, counts in pieces], dim=1)  # [dest rank, chunk, expert]
    received = torch.empty_like(sent)
    started = time.perf_counter()
    dist.all_to_all_single(received, sent, group=group)  # every chunk's counts in one small exchange
    traffic.all_to_all_s += time.perf_counter() - started
    plans = [_ChunkPlan(send_splits=sent[:, c].sum(dim=1).tolist(), received_counts=received[:, c])
             for c in range(chunks)]

    def dispatch(c: int) -> tuple[torch.Tensor, list]:
        slots, _, _ = pieces[c]
        pending: list = []
        return _AllToAllStart.apply(slots, plans[c].receive_splits, plans[c].send_splits, group, traffic,
                                    pending), pending

    combines, in_flight = [], dispatch(0)
    for c in range(chunks):
        rows = _AllToAllWait.apply(in_flight[0], in_flight[1], traffic)
        if c + 1 < chunks:
            in_flight = dispatch(c + 1)
        outputs = _run_received(rows, plans[c].received_counts, local_experts)
        pending: list = []
        combines.append((_AllToAllStart.apply(outputs, plans[c].send_splits, plans[c].receive_splits, group, traffic,
                                              pending), pending))
    routed = []
    for (combined, pending), (_, order, _), part_weights, part in zip(
            combines, pieces, gate_weights.tensor_split(chunks), parts):
        expert_out = _AllToAllWait.apply(combined, pending, traffic)
        weighted = expert_out * part_weights.reshape(-1)[order].unsqueeze(-1).to(expert_out.dtype)
        routed.append(torch.zeros_like(part).index_add_(0, order // top_k, weighted.to(part.dtype)))
    return torch.cat(routed)


@dataclass(frozen=True)
class _ChunkPlan:
    send_splits: list[int]  # rows to each rank
    received_counts: torch.Tensor  # [source rank, local expert] rows coming in

    @property
    def receive_splits(self) -> list[int]:
        return self.received_counts.sum(dim=1).tolist()


def _sorted_slots(tokens: torch.Tensor, expert_index: torch.Tensor, top_k: int,
                  num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slots grouped by expert, the order that groups them, slots per expert); a token's k slots are
    rows order // k of `tokens`, and within an expert tokens keep their order."""
    flat = expert_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return tokens[order // top_k], order, torch.bincount(flat, minlength=num_experts)


def _run_received(rows: torch.Tensor, received_counts: torch.Tensor, local_experts: LocalExperts) -> torch.Tensor:
    """Run the local experts on rows received source-major; return their outputs in the same order."""
    ranks, local = received_counts.shape
    expert_of_row = torch.arange(local, device=rows.device).repeat(ranks).repeat_interleave(received_counts.reshape(-1))
    by_expert = torch.argsort(expert_of_row, stable=True)
    outputs = local_experts(rows[by_expert], received_counts.sum(dim=0).tolist())
    return outputs[inverse_permutation(by_expert)]


class SharedExperts(nn.Module):
    def __init__(self, hidden: int, ffn_hidden: int):
        super().__init__()
        self.up = nn.Linear(hidden, ffn_hidden, bias=False)
        self.down = nn.Linear(ffn_hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def exchange_with_experts(slots: torch.Tensor, counts: torch.Tensor, experts: LocalExperts, num_experts: int,
                          group: dist.ProcessGroup, traffic: ExpertTraffic,
                          alongside_dispatch: Callable[[], torch.Tensor] | None = None) -> tuple[torch.Tensor, Any]:
    """Send each slot (grouped by global expert) to its expert's rank, run the experts there, bring results back;
    `alongside_dispatch` (e.g. the shared experts) runs while the slots are on their way.

    Splits are uneven: rank r sends `counts` of its experts' slots to the expert's owner, and first
    learns through a small all-to-all how many slots each peer sends it per local expert.
    """
    ranks = dist.get_world_size(group)
    local_experts = num_experts // ranks
    received_counts = torch.empty_like(counts)
    started = time.perf_counter()
    dist.all_to_all_single(received_counts, counts, group=group)
    traffic.all_to_all_s += time.perf_counter() - started
    received_counts = received_counts.view(ranks, local_experts)  # [source rank, local expert]
    send_splits = counts.view(ranks, local_experts).sum(dim=1).tolist()
    receive_splits = received_counts.sum(dim=1).tolist()
    received, alongside = all_to_all(slots, receive_splits, send_splits, group, traffic, alongside_dispatch)
    outputs = _run_received(received, received_counts, experts)
    combined, _ = all_to_all(outputs, send_splits, receive_splits, group, traffic)
    return combined, alongside


def inverse_permutation(permutation: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(permutation)
    inverse[permutation] = torch.arange(len(permutation), device=permutation.device)
    return inverse


class _AllToAllStart(torch.autograd.Function):
    """Rows of `tensor` split by `input_splits` to the group's ranks, issued without waiting: `pending`
    receives the work `_AllToAllWait` waits for. The backward sends the gradients back."""

    @staticmethod
    def forward(ctx, tensor, output_splits, input_splits, group, traffic, pending):
        ctx.output_splits, ctx.input_splits, ctx.group, ctx.traffic = output_splits, input_splits, group, traffic
        output = tensor.new_empty((sum(output_splits), *tensor.shape[1:]))
        pending.append(dist.all_to_all_single(output, tensor.contiguous(), output_splits, input_splits, group=group,
                                              async_op=True))
        return output

    @staticmethod
    def backward(ctx, grad_output):
        grad_input = grad_output.new_empty((sum(ctx.input_splits), *grad_output.shape[1:]))
        started = time.perf_counter()
        dist.all_to_all_single(grad_input, grad_output.contiguous(), ctx.input_splits, ctx.output_splits,
                               group=ctx.group)
        ctx.traffic.all_to_all_s += time.perf_counter() - started
        return grad_input, None, None, None, None, None


class _AllToAllWait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, in_flight, pending, traffic):
        started = time.perf_counter()
        pending.pop().wait()
        traffic.all_to_all_s += time.perf_counter() - started  # only the part not hidden behind other work
        return in_flight.view_as(in_flight)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None, None


def all_to_all(tensor: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup,
               traffic: ExpertTraffic, alongside: Callable[[], Any] | None = None) -> tuple[torch.Tensor, Any]:
    """Differentiable uneven all-to-all of rows (dim 0), its waiting time added to `traffic`; `alongside`
    runs while the rows are in flight. Returns (rows received, what `alongside` returned)."""
    pending: list[dist.Work] = []
    in_flight = _AllToAllStart.apply(tensor, output_splits, input_splits, group, traffic, pending)
    result = alongside() if alongside is not None else None
    return _AllToAllWait.apply(in_flight, pending, traffic), result
