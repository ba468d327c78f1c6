"""Expert-parallel serving: a replica's experts spread over expert ranks and re-placed from observed load.

The serving process (rank 0) runs the model as ever: attention, routers, the KV cache, the
continuous-batching engine. Each MoE layer hands its routed slots, grouped by expert, to an
`ExpertDispatcher`, which cuts each expert's tokens over the physical copies of that expert
(policies/expert_placement.py), sends each rank the rows of the slots it holds, computes its own
slots meanwhile and puts the outputs back in the order the layer expects. Ranks 1..N-1
(`serve_experts`) hold only their slots' expert weights and answer in a loop. Every copy of an
expert holds the same weights, so the tokens generated do not depend on the placement.

On the wire (torch.distributed: gloo on CPU, NCCL between GPUs), rank 0 broadcasts a fixed-size
header saying what comes next: run a layer (with the rows each physical slot gets), take a new
placement (then the weights of the slots that changed, or of every slot after new weights were
loaded, point to point), or stop. Rows and outputs
travel point to point, and only to ranks that have rows.

With `rebalance_every` set, rank 0 re-places the experts every that many forwards, between two
forwards, from the tokens each expert received since the last placement: the hottest experts get
the spare slots (EPLB's redundant experts) and the copies are packed so the busiest rank is as
light as possible. Rank 0 keeps the whole expert tensors as the source of every move.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from baige_ray.api.validation import require_int
from baige_ray.policies.expert_placement import (
    ExpertPlacement,
    balance_experts,
    imbalance,
    initial_placement,
    replica_shares,
)

_STOP, _RUN, _PLACE = 0, 1, 2
_HEADER = 3  # op, layer, row width; then the rows of every physical slot


@dataclass(kw_only=True, frozen=True)
class ExpertParallelServing:
    """Serve an MoE model's experts over `ranks` processes (the replica's own included).

    `slots_per_rank` physical experts per rank and layer (None: an even share plus one spare for a
    hot expert's copy); `rebalance_every` forwards between re-placements from observed load (None:
    keep the first placement)."""

    ranks: int = 2
    slots_per_rank: int | None = None
    rebalance_every: int | None = 64

    def __post_init__(self) -> None:
        require_int("ExpertParallelServing", "ranks", self.ranks, minimum=2)
        if self.slots_per_rank is not None:
            require_int("ExpertParallelServing", "slots_per_rank", self.slots_per_rank, minimum=1)
        if self.rebalance_every is not None:
            require_int("ExpertParallelServing", "rebalance_every", self.rebalance_every, minimum=1)

    def slots_for(self, num_experts: int) -> int:
        if self.slots_per_rank is not None:
            if self.ranks * self.slots_per_rank < num_experts or self.slots_per_rank > num_experts:
                raise ValueError(f"ExpertParallelServing.slots_per_rank={self.slots_per_rank} is invalid for "
                                 f"{num_experts} experts over {self.ranks} ranks: expected between "
                                 f"{math.ceil(num_experts / self.ranks)} and {num_experts}")
            return self.slots_per_rank
        return min(num_experts, math.ceil(num_experts / self.ranks) + 1)


@dataclass(frozen=True)
class ExpertLayerSpec:
    """What an expert rank needs to run one layer's experts: the computation and its tensors' shapes."""

    kernel: Callable[[dict[str, torch.Tensor], torch.Tensor, list[int]], torch.Tensor]
    shapes: dict[str, tuple[int, ...]]  # per expert
    dtype: torch.dtype
    num_experts: int


def layer_specs(layers: list[nn.Module]) -> list[ExpertLayerSpec]:
    specs = []
    for layer in layers:
        weights = layer.expert_weights()
        first = next(iter(weights.values()))
        specs.append(ExpertLayerSpec(kernel=layer.expert_kernel(), dtype=first.dtype, num_experts=first.shape[0],
                                     shapes={name: tuple(tensor.shape[1:]) for name, tensor in weights.items()}))
    return specs


def _slot_weights(full: dict[str, torch.Tensor], experts: tuple[int, ...]) -> dict[str, torch.Tensor]:
    return {name: tensor[torch.tensor(experts, device=tensor.device)].clone() for name, tensor in full.items()}


def _changed_slots(old: ExpertPlacement | None, new: ExpertPlacement, rank: int) -> list[tuple[int, int]]:
    """(slot j of `rank`, its new expert) for the slots whose expert differs from the old placement."""
    before = old.rank_slots(rank) if old is not None else (None,) * new.slots_per_rank
    return [(j, expert) for j, (was, expert) in enumerate(zip(before, new.rank_slots(rank))) if was != expert]


class ExpertDispatcher:
    """Rank 0: runs each MoE layer's experts over the expert ranks (see the module doc)."""

    def __init__(self, layers: list[nn.Module], options: ExpertParallelServing):
        if not layers:
            raise ValueError("expert-parallel serving needs a mixture-of-experts model: this one has no expert layers")
        if dist.get_world_size() != options.ranks or dist.get_rank() != 0:
            raise RuntimeError(f"the expert group must have {options.ranks} ranks with the dispatcher at rank 0")
        self.options, self.layers = options, layers
        self.num_experts = next(iter(layers[0].expert_weights().values())).shape[0]
        self.slots_per_rank = options.slots_for(self.num_experts)
        # The model's own expert tensors (views, not copies): the source of every move, updated in place
        # when new weights are loaded.
        self.full = [layer.expert_weights() for layer in layers]
        self.device = next(iter(self.full[0].values())).device
        self.kernels = [layer.expert_kernel() for layer in layers]
        self.local: list[dict[str, torch.Tensor]] = [{} for _ in layers]
        self.expert_load = torch.zeros(len(layers), self.num_experts, dtype=torch.float64)
        self.rank_rows = torch.zeros(options.ranks, dtype=torch.float64)
        self.forwards = self.placed_at = 0
        self.placements_made = 0
        self._header = torch.zeros(_HEADER + options.ranks * self.slots_per_rank, dtype=torch.int64,
                                   device=self.device)
        first = initial_placement(self.num_experts, options.ranks, self.slots_per_rank)
        self.placements = [first] * len(layers)
        self._place(self.placements, previous=[None] * len(layers))
        for index, layer in enumerate(layers):
            layer.run_experts_with(self._runner(index))

    def _runner(self, layer: int) -> Callable[[torch.Tensor, list[int]], torch.Tensor]:
        return lambda rows, counts: self.run(layer, rows, counts)

    # ---- one layer ---------------------------------------------------------------------------

    def run(self, layer: int, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Outputs for `rows` grouped by expert (`counts[e]` rows of expert e), in the same order."""
        if layer == 0:
            self._start_forward()
        placement = self.placements[layer]
        self.expert_load[layer] += torch.tensor(counts, dtype=torch.float64)
        order, slot_counts = self._slot_order(placement, counts)
        by_slot = rows[order]
        per_rank = [sum(slot_counts[r * self.slots_per_rank:(r + 1) * self.slots_per_rank])
                    for r in range(self.options.ranks)]
        self.rank_rows += torch.tensor(per_rank, dtype=torch.float64)
        self._header.copy_(torch.tensor([_RUN, layer, rows.shape[-1], *slot_counts]))
        dist.broadcast(self._header, src=0)
        parts = list(by_slot.split(per_rank))
        pending, outputs = [], [None] * self.options.ranks
        for rank in range(1, self.options.ranks):
            if per_rank[rank]:
                pending.append(dist.isend(parts[rank].contiguous(), dst=rank))
                outputs[rank] = torch.empty_like(parts[rank])
                pending.append(dist.irecv(outputs[rank], src=rank))
        own = slot_counts[:self.slots_per_rank]
        outputs[0] = self.kernels[layer](self.local[layer], parts[0], own) if per_rank[0] else parts[0]
        for work in pending:
            work.wait()
        result = torch.empty_like(by_slot)
        result[order] = torch.cat([o for o in outputs if o is not None])
        return result

    def _slot_order(self, placement: ExpertPlacement, counts: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Row indices in physical-slot order and the rows of each slot: an expert's rows cut over its copies."""
        starts = [0]
        for count in counts[:-1]:
            starts.append(starts[-1] + count)
        slot_range: dict[int, tuple[int, int]] = {}
        for expert, count in enumerate(counts):
            copies = placement.copies(expert)
            offset = starts[expert]
            for slot, share in zip(copies, replica_shares(count, len(copies))):
                slot_range[slot] = (offset, share)
                offset += share
        ranges = [slot_range[slot] for slot in range(len(placement.slots))]
        order = torch.cat([torch.arange(start, start + share) for start, share in ranges])
        return order.to(self.device), [share for _, share in ranges]

    # ---- placement -----------------------------------------------------------------------------

    def _start_forward(self) -> None:
        every = self.options.rebalance_every
        if every is not None and self.forwards - self.placed_at >= every:
            self.rebalance()
        self.forwards += 1

    def rebalance(self) -> dict[str, Any]:
        """Re-place every layer's experts from the load since the last placement; returns what it saw."""
        observed = self.stats()
        placements = [balance_experts(load.tolist(), self.options.ranks, self.slots_per_rank) if load.sum() > 0
                      else placement for load, placement in zip(self.expert_load, self.placements)]
        self._place(placements, previous=self.placements)
        return observed

    def stats(self) -> dict[str, Any]:
        """Rows per rank since the last placement, their imbalance (max / mean), and the placements."""
        rows = [int(value) for value in self.rank_rows.tolist()]
        return {"rank_rows": rows, "imbalance": imbalance(rows), "placements_made": self.placements_made,
                "slots": [list(p.slots) for p in self.placements]}

    def _place(self, placements: list[ExpertPlacement], previous: list[ExpertPlacement | None]) -> None:
        """Make `placements` current; ranks receive the weights of their slots that differ from `previous`."""
        self._header.zero_()
        self._header[0] = _PLACE
        self._header[1] = int(all(old is None for old in previous))  # every slot anew: new weights
        dist.broadcast(self._header, src=0)
        dist.broadcast(torch.tensor([p.slots for p in placements], dtype=torch.int64, device=self.device), src=0)
        for rank in range(1, self.options.ranks):
            for layer, placement in enumerate(placements):
                for _, expert in _changed_slots(previous[layer], placement, rank):
                    for name in sorted(self.full[layer]):
                        dist.send(self.full[layer][name][expert].contiguous(), dst=rank)
        for layer, placement in enumerate(placements):
            self.local[layer] = _slot_weights(self.full[layer], placement.rank_slots(0))
        self.placements = list(placements)
        self.expert_load.zero_()
        self.rank_rows.zero_()
        self.placed_at, self.placements_made = self.forwards, self.placements_made + 1

    def reload_weights(self) -> None:
        """The model's experts hold new weights (loaded in place): every rank gets its slots' weights anew."""
        self.full = [layer.expert_weights() for layer in self.layers]
        self._place(self.placements, previous=[None] * len(self.layers))  # every slot counts as changed

    def close(self) -> None:
        """Stop the expert ranks' loops; the layers compute their experts here again."""
        for layer in self.layers:
            layer.run_experts_with(None)
        self._header.zero_()
        self._header[0] = _STOP
        dist.broadcast(self._header, src=0)


@torch.inference_mode()
def serve_experts(specs: list[ExpertLayerSpec], options: ExpertParallelServing, device: str = "cpu") -> int:
    """Ranks 1..N-1: hold the slots rank 0 places here and compute them until told to stop; returns
    the layer forwards served."""
    rank, ranks = dist.get_rank(), options.ranks
    slots = options.slots_for(specs[0].num_experts)
    header = torch.zeros(_HEADER + ranks * slots, dtype=torch.int64, device=device)
    placements: list[ExpertPlacement | None] = [None] * len(specs)
    weights = [{name: torch.empty((slots, *shape), dtype=spec.dtype, device=device)
                for name, shape in spec.shapes.items()} for spec in specs]
    served = 0
    while True:
        dist.broadcast(header, src=0)
        op = int(header[0])
        if op == _STOP:
            return served
        if op == _PLACE:
            table = torch.empty(len(specs), ranks * slots, dtype=torch.int64, device=device)
            dist.broadcast(table, src=0)
            new = [ExpertPlacement(slots=tuple(row.tolist()), num_ranks=ranks) for row in table]
            if int(header[1]):
                placements = [None] * len(specs)
            for layer, placement in enumerate(new):
                for slot, _ in _changed_slots(placements[layer], placement, rank):
                    for name in sorted(weights[layer]):
                        received = torch.empty_like(weights[layer][name][slot])
                        dist.recv(received, src=0)
                        weights[layer][name][slot] = received
            placements = new
            continue
        layer, width = int(header[1]), int(header[2])
        counts = header[_HEADER:].view(ranks, slots)[rank].tolist()
        if sum(counts):
            rows = torch.empty(sum(counts), width, dtype=specs[layer].dtype, device=device)
            dist.recv(rows, src=0)
            dist.send(specs[layer].kernel(weights[layer], rows, counts).contiguous(), dst=0)
        served += 1
