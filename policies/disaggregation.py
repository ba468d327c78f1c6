"""How a disaggregated application splits its replicas between prefill and decode (pure, no Ray).

Each side is sized from its own queue: on the prefill side, prompts waiting for or in a prefill; on
the decode side, rows waiting for or in the running batch. A side's utilization is that count over
what its replicas hold at full use (`prefill_capacity` prompts, `decode_capacity` rows each), which
puts the two sides' queues in one unit.

The pool arbiter decides how many devices serving holds (policies/lending.py); this policy splits
them:
- replicas a lend adds go one by one to the side that is busier at that moment; replicas a reclaim
  takes come one by one from the side that stays least busy without them. A side never drops below
  its minimum, and a side found below it (a replica died) is restored first;
- with the total unchanged, one replica moves from the idler side to the busier one when the busier
  side is busier, by more than `margin`, than the donor would be after giving it up, and no move
  happened in the last `cooldown_s`. A move costs a replica stop and a start; the margin keeps two
  nearly equal sides from trading a replica back and forth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from baige_ray.api.validation import require_int, require_number

SIDES = ("prefill", "decode")


@dataclass(kw_only=True, frozen=True)
class SideLoad:
    """One side's replicas and queue, as its replicas last reported them."""

    num_replicas: int
    num_waiting: int  # requests queued for the side's engines
    num_running: int  # requests the side's engines are computing (prefill: this step's prompts; decode: rows)

    def __post_init__(self) -> None:
        for name in ("num_replicas", "num_waiting", "num_running"):
            require_int("SideLoad", name, getattr(self, name), minimum=0)

    @property
    def num_requests(self) -> int:
        return self.num_waiting + self.num_running


@dataclass(kw_only=True, frozen=True)
class SplitPolicy:
    prefill_capacity: float = 4.0  # prompts one prefill replica holds at full use (waiting + prefilling)
    decode_capacity: float = 16.0  # rows one decode replica holds at full use (waiting + decoding)
    margin: float = 0.25  # utilization by which the busier side must exceed the donor after a move
    cooldown_s: float = 10.0  # between two moves with the total unchanged
    min_prefill_replicas: int = 1
    min_decode_replicas: int = 1

    def __post_init__(self) -> None:
        for name in ("prefill_capacity", "decode_capacity"):
            require_number("SplitPolicy", name, getattr(self, name), minimum=0, exclusive_minimum=True)
        for name in ("margin", "cooldown_s"):
            require_number("SplitPolicy", name, getattr(self, name), minimum=0)
        for name in ("min_prefill_replicas", "min_decode_replicas"):
            require_int("SplitPolicy", name, getattr(self, name), minimum=1)

    @property
    def min_replicas(self) -> int:
        return self.min_prefill_replicas + self.min_decode_replicas


@dataclass(kw_only=True, frozen=True)
class SplitObservation:
    prefill: SideLoad
    decode: SideLoad
    num_replicas: int  # the replicas serving holds from now on (the arbiter's decision)
    seconds_since_move: float

    def __post_init__(self) -> None:
        require_int("SplitObservation", "num_replicas", self.num_replicas, minimum=2)
        require_number("SplitObservation", "seconds_since_move", self.seconds_since_move, minimum=0)


@dataclass(frozen=True)
class SplitDecision:
    prefill_replicas: int
    decode_replicas: int
    reason: str

    def changes(self, obs: SplitObservation) -> bool:
        return (self.prefill_replicas, self.decode_replicas) != (obs.prefill.num_replicas, obs.decode.num_replicas)


class _Split:
    """The replica counts being decided, and each side's utilization at a count."""

    def __init__(self, obs: SplitObservation, policy: SplitPolicy):
        self.loads = {"prefill": obs.prefill, "decode": obs.decode}
        self.capacity = {"prefill": policy.prefill_capacity, "decode": policy.decode_capacity}
        self.minimum = {"prefill": policy.min_prefill_replicas, "decode": policy.min_decode_replicas}
        self.counts = {side: max(self.loads[side].num_replicas, self.minimum[side]) for side in SIDES}

    def utilization(self, side: str, replicas: int | None = None) -> float:
        replicas = self.counts[side] if replicas is None else replicas
        requests = self.loads[side].num_requests
        if replicas <= 0:
            return math.inf if requests else 0.0
        return requests / (replicas * self.capacity[side])

    def add_one(self) -> None:
        """To the busier side (ties: the smaller, then decode)."""
        side = max(SIDES, key=lambda s: (self.utilization(s), -self.counts[s], s == "decode"))
        self.counts[side] += 1

    def remove_one(self) -> None:
        """From the side least busy without it (ties: the larger, then prefill), above its minimum."""
        spare = [s for s in SIDES if self.counts[s] > self.minimum[s]]
        side = min(spare, key=lambda s: (self.utilization(s, self.counts[s] - 1), -self.counts[s], s == "decode"))
        self.counts[side] -= 1

    def changed(self) -> bool:
        return any(self.counts[side] != self.loads[side].num_replicas for side in SIDES)

    def decision(self, reason: str) -> SplitDecision:
        return SplitDecision(self.counts["prefill"], self.counts["decode"], reason)

    def describe(self) -> str:
        return ", ".join(f"{side} {self.counts[side]} at {self.utilization(side):.2f}" for side in SIDES)


def split_replicas(obs: SplitObservation, policy: SplitPolicy | None = None) -> SplitDecision:
    """How many of `obs.num_replicas` serve prefills and how many decode."""
    policy = policy or SplitPolicy()
    if obs.num_replicas < policy.min_replicas:
        raise ValueError(f"SplitObservation.num_replicas={obs.num_replicas} is invalid: expected at least "
                         f"min_prefill_replicas + min_decode_replicas = {policy.min_replicas}")
    split = _Split(obs, policy)
    for _ in range(obs.num_replicas - sum(split.counts.values())):
        split.add_one()
    for _ in range(sum(split.counts.values()) - obs.num_replicas):
        split.remove_one()
    if split.changed():
        return split.decision(f"{obs.num_replicas} replicas: {split.describe()}")
    if obs.seconds_since_move < policy.cooldown_s:
        return split.decision(f"cooling down ({obs.seconds_since_move:.1f}s of {policy.cooldown_s:g}s): "
                              f"{split.describe()}")
    busier = max(SIDES, key=split.utilization)
    idler = "decode" if busier == "prefill" else "prefill"
    after = split.utilization(idler, split.counts[idler] - 1)
    if split.counts[idler] > split.minimum[idler] and split.utilization(busier) > after + policy.margin:
        reason = (f"{busier} at {split.utilization(busier):.2f}, {idler} at {after:.2f} with one replica "
                  f"fewer: move one to {busier}")
        split.counts[idler] -= 1
        split.counts[busier] += 1
        return split.decision(reason)
    return split.decision(f"balanced: {split.describe()}")
