"""Expert placement for expert-parallel serving, rebalanced from observed load (EPLB-style; pure, no Ray).

Each of `num_ranks` expert ranks holds `slots_per_rank` physical experts of every MoE layer; with
more slots than logical experts, hot experts get replicas. Per layer, from the tokens each logical
expert received:

1. Replicate: every expert starts with one physical copy; each extra slot goes to the expert whose
   load per copy is highest (so the busiest experts split their tokens over several ranks).
2. Pack: copies, heaviest first (load per copy), go to the least-loaded rank that still has a free
   slot and does not hold that expert yet (a second copy on the same rank would relieve nothing),
   so every rank ends with exactly `slots_per_rank` slots and the heaviest rank is as light as this
   greedy order gets.

A token routed to an expert with k copies goes to one of them: the expert's tokens are cut into k
contiguous, near-equal shares in slot order (`replica_shares`), so the split is deterministic and
the outputs do not depend on the placement (every copy holds the same weights).

`imbalance` is the quantity EPLB minimizes: the busiest rank's tokens over the mean rank's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from baige_ray.api.validation import require_int


@dataclass(frozen=True)
class ExpertPlacement:
    """Logical expert of each physical slot, rank-major: `slots[r * slots_per_rank + j]` is rank r's j-th."""

    slots: tuple[int, ...]
    num_ranks: int

    def __post_init__(self) -> None:
        require_int("ExpertPlacement", "num_ranks", self.num_ranks, minimum=1)
        object.__setattr__(self, "slots", tuple(int(expert) for expert in self.slots))
        if not self.slots or len(self.slots) % self.num_ranks:
            raise ValueError(f"ExpertPlacement.slots has {len(self.slots)} entries: expected a positive multiple "
                             f"of num_ranks={self.num_ranks}")
        copies: dict[int, list[int]] = {}
        for slot, expert in enumerate(self.slots):
            copies.setdefault(expert, []).append(slot)
        # Looked up for every expert of every MoE layer of every forward: built once, not scanned each time.
        object.__setattr__(self, "_copies", {expert: tuple(slots) for expert, slots in copies.items()})

    @property
    def slots_per_rank(self) -> int:
        return len(self.slots) // self.num_ranks

    def rank_slots(self, rank: int) -> tuple[int, ...]:
        start = rank * self.slots_per_rank
        return self.slots[start:start + self.slots_per_rank]

    def copies(self, expert: int) -> tuple[int, ...]:
        """The physical slots holding `expert`, in slot order."""
        return self._copies.get(expert, ())

    def covers(self, num_experts: int) -> bool:
        return set(self.slots) == set(range(num_experts))


def initial_placement(num_experts: int, num_ranks: int, slots_per_rank: int) -> ExpertPlacement:
    """No load seen yet: experts in order, round-robin copies of the first ones fill the spare slots."""
    _check_sizes(num_experts, num_ranks, slots_per_rank)
    return balance_experts([1.0] * num_experts, num_ranks, slots_per_rank)


def balance_experts(load: list[float], num_ranks: int, slots_per_rank: int) -> ExpertPlacement:
    """Replicate the hottest experts into the spare slots, then pack the copies onto ranks (see module doc)."""
    num_experts = len(load)
    _check_sizes(num_experts, num_ranks, slots_per_rank)
    if any(value < 0 or math.isnan(value) for value in load):
        raise ValueError(f"expert load {list(load)} is invalid: expected non-negative token counts")
    copies = [1] * num_experts
    for _ in range(num_ranks * slots_per_rank - num_experts):
        spreadable = [e for e in range(num_experts) if copies[e] < num_ranks]  # at most one copy per rank
        hottest = max(spreadable, key=lambda e: (load[e] / copies[e], -e))
        copies[hottest] += 1
    pieces = sorted(((load[e] / copies[e], e) for e in range(num_experts) for _ in range(copies[e])),
                    key=lambda piece: (-piece[0], piece[1]))
    ranks: list[list[int]] = [[] for _ in range(num_ranks)]
    rank_load = [0.0] * num_ranks
    for piece_load, expert in pieces:
        open_ranks = [r for r in range(num_ranks) if len(ranks[r]) < slots_per_rank]
        fresh = [r for r in open_ranks if expert not in ranks[r]] or open_ranks
        rank = min(fresh, key=lambda r: (rank_load[r], r))  # fresh is empty only if greedy order boxed itself in
        ranks[rank].append(expert)
        rank_load[rank] += piece_load
    return ExpertPlacement(slots=tuple(expert for held in ranks for expert in sorted(held)), num_ranks=num_ranks)


def replica_shares(count: int, num_copies: int) -> list[int]:
    """Tokens each of an expert's copies takes, in slot order: contiguous, near-equal, earlier copies the extra."""
    base, extra = divmod(count, num_copies)
    return [base + (1 if index < extra else 0) for index in range(num_copies)]


def rank_tokens(placement: ExpertPlacement, expert_tokens: list[int]) -> list[int]:
    """Tokens each rank computes when each expert's tokens split over its copies by `replica_shares`."""
    per_slot = [0] * len(placement.slots)
    for expert, count in enumerate(expert_tokens):
        copies = placement.copies(expert)
        for slot, share in zip(copies, replica_shares(count, len(copies))):
            per_slot[slot] = share
    size = placement.slots_per_rank
    return [sum(per_slot[r * size:(r + 1) * size]) for r in range(placement.num_ranks)]


def imbalance(tokens_per_rank: list[int]) -> float:
    """Busiest rank over the mean rank (1.0: perfectly even; 1.0 too when nothing was routed)."""
    mean = sum(tokens_per_rank) / len(tokens_per_rank)
    return max(tokens_per_rank) / mean if mean > 0 else 1.0


def _check_sizes(num_experts: int, num_ranks: int, slots_per_rank: int) -> None:
    require_int("ExpertPlacement", "num_experts", num_experts, minimum=1)
    require_int("ExpertPlacement", "num_ranks", num_ranks, minimum=1)
    require_int("ExpertPlacement", "slots_per_rank", slots_per_rank, minimum=1)
    if slots_per_rank > num_experts:
        raise ValueError(f"ExpertPlacement.slots_per_rank={slots_per_rank} is invalid: expected at most "
                         f"num_experts={num_experts} (a rank holds each expert at most once)")
    if num_ranks * slots_per_rank < num_experts:
        raise ValueError(f"ExpertPlacement.slots_per_rank={slots_per_rank} is invalid: {num_ranks} ranks x "
                         f"{slots_per_rank} slots cannot hold {num_experts} experts")
