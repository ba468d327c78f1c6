"""Lending policy: how many devices inference borrows from training right now (pure, no Ray).

Inference utilization is the request rate over what the inference devices sustain within the
latency objective (`replica_capacity` requests/s each). Hysteresis keeps the pool from thrashing:

- lend when utilization rises above `lend_above`, sizing inference so utilization falls to
  `target_utilization`;
- reclaim only when, even with the devices given back, utilization would stay at or below
  `reclaim_below` (< target < lend_above) and the p99 is well inside the objective;
- after any change, wait `cooldown_s` before the next one, so a change's effect is measured first.

A lend takes effect only once the new replica is up (seconds to tens of seconds), so the policy plans
for the rate it will face by then, not the rate now: `forecast_rate` extrapolates the recent trend of
the request rate one lend latency ahead, and lending and reclaiming both use the larger of the rate
now and that forecast. Rising load is met before it arrives; falling load is given back only once
even the near future no longer needs the devices (if it rises again, a lend started then still comes
in time).

An SLO breach (p99 above the objective, or a queue deeper than the replicas can absorb) lends at
once, ignoring the cool-down except for a short `breach_cooldown_s` that lets the last lend's new
replica show up in the latency window. A breach while the replicas are lightly loaded (utilization
below `breach_min_utilization`) is not a shortage of devices but a passing stall (a neighbour's
burst of work on shared hosts, a backlog draining): another replica would not fix it, and starting
one costs a training resize, so the policy holds. Training shrinks and grows only by whole data-parallel
replicas (`devices_per_train_replica` devices each), only to sizes it can run at (`train_sizes`,
e.g. those whose data-parallel degree splits the global batch) and never below `min_train_devices`.

Harvesting (`harvest_below` set): a lightly loaded inference device also runs one low-priority
training rank beside its replica, so its idle time trains instead of idling. A shared device counts
as `shared_capacity` of a replica. The policy harvests while the utilization, counted that way,
stays at or below `harvest_below`. When the load rises it first gives shared devices back to
inference ("unharvest"), and lends whole devices only once none is shared. Giving a device back
costs one training regroup; a lend costs a replica start. With harvesting on, whole devices are not
reclaimed: the replicas stay warm, and falling load is met by harvesting their devices.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

from baige_ray.api.validation import require_int, require_number


class LendingAction(enum.Enum):
    LEND = "lend"
    RECLAIM = "reclaim"
    HARVEST = "harvest"  # run training ranks beside replicas on `num_devices` more inference devices
    UNHARVEST = "unharvest"  # stop the training ranks on `num_devices` shared inference devices
    HOLD = "hold"


@dataclass(kw_only=True, frozen=True)
class LendingObservation:
    request_rate: float  # requests/s over the recent window
    p99_latency_s: float
    slo_p99_s: float
    queue_depth: int  # requests the replicas hold now
    train_devices: int
    infer_devices: int
    min_train_devices: int
    replica_capacity: float  # requests/s one inference device sustains within the objective
    seconds_since_change: float
    devices_per_train_replica: int = 1
    min_infer_devices: int = 1
    train_sizes: tuple[int, ...] | None = None  # sizes training can run at; None: any whole replicas
    forecast_rate: float | None = None  # requests/s expected one lend latency from now; None: no forecast
    harvested_devices: int = 0  # inference devices that also run a training rank
    shared_capacity: float = 0.5  # what a shared device serves, as a fraction of replica_capacity

    def __post_init__(self) -> None:
        for name in ("request_rate", "p99_latency_s", "seconds_since_change"):
            require_number("LendingObservation", name, getattr(self, name), minimum=0)
        if self.forecast_rate is not None:
            require_number("LendingObservation", "forecast_rate", self.forecast_rate, minimum=0)
        for name in ("slo_p99_s", "replica_capacity"):
            require_number("LendingObservation", name, getattr(self, name), minimum=0, exclusive_minimum=True)
        for name in ("queue_depth", "train_devices", "infer_devices", "min_train_devices", "min_infer_devices",
                     "harvested_devices"):
            require_int("LendingObservation", name, getattr(self, name), minimum=0)
        if self.harvested_devices > self.infer_devices:
            raise ValueError(f"LendingObservation.harvested_devices={self.harvested_devices} is invalid: "
                             f"expected at most infer_devices={self.infer_devices}")
        require_number("LendingObservation", "shared_capacity", self.shared_capacity, minimum=0, maximum=1,
                       exclusive_minimum=True)
        require_int("LendingObservation", "devices_per_train_replica", self.devices_per_train_replica, minimum=1)
        if self.train_sizes is not None:
            for size in self.train_sizes:
                require_int("LendingObservation", "train_sizes", size, minimum=1)

    def sizes(self) -> list[int]:
        """Training sizes the pool allows, at or above the minimum, ascending."""
        total = self.train_devices + self.infer_devices
        unit = self.devices_per_train_replica
        sizes = self.train_sizes if self.train_sizes is not None else range(unit, total + 1, unit)
        return sorted(s for s in sizes if self.min_train_devices <= s <= total and s % unit == 0)

    @property
    def planning_rate(self) -> float:
        """The rate to provision for: the larger of the rate now and the forecast."""
        return max(self.request_rate, self.forecast_rate or 0.0)

    @property
    def utilization(self) -> float:
        """Planning rate over what the current inference devices sustain (inf with no devices and some load)."""
        return self.utilization_with(self.harvested_devices)

    def utilization_with(self, harvested: int) -> float:
        """The utilization were `harvested` of the inference devices shared with training."""
        devices = self.infer_devices - harvested + self.shared_capacity * harvested
        if devices <= 0:
            return math.inf if self.planning_rate > 0 else 0.0
        return self.planning_rate / (devices * self.replica_capacity)

    def harvest_sizes_ok(self, harvested: int) -> bool:
        """Whether training can run with `harvested` ranks beside its whole devices."""
        total = self.train_devices + harvested
        return self.train_sizes is None or total in self.train_sizes


@dataclass(kw_only=True, frozen=True)
class LendingPolicy:
    lend_above: float = 0.8
    target_utilization: float = 0.6
    reclaim_below: float = 0.45
    cooldown_s: float = 10.0
    breach_cooldown_s: float = 3.0
    reclaim_latency_fraction: float = 0.5  # reclaim only while p99 <= this fraction of the objective
    queue_per_device: int = 16  # a deeper queue than this per inference device counts as a breach
    breach_min_utilization: float = 0.0  # a breach lends only at or above this utilization
    harvest_below: float | None = None  # harvest while utilization stays at or below this; None: never

    def __post_init__(self) -> None:
        for name in ("lend_above", "target_utilization", "reclaim_below", "reclaim_latency_fraction"):
            require_number("LendingPolicy", name, getattr(self, name), minimum=0, exclusive_minimum=True)
        if not self.reclaim_below < self.target_utilization < self.lend_above:
            raise ValueError(
                f"LendingPolicy thresholds are invalid: expected reclaim_below={self.reclaim_below} < "
                f"target_utilization={self.target_utilization} < lend_above={self.lend_above} (the hysteresis band)"
            )
        for name in ("cooldown_s", "breach_cooldown_s", "breach_min_utilization"):
            require_number("LendingPolicy", name, getattr(self, name), minimum=0)
        require_int("LendingPolicy", "queue_per_device", self.queue_per_device, minimum=1)
        if self.harvest_below is not None and not 0 < self.harvest_below < self.lend_above:
            raise ValueError(f"LendingPolicy.harvest_below={self.harvest_below} is invalid: expected in "
                             f"(0, lend_above={self.lend_above}), or a shared device would be given back at once")


@dataclass(frozen=True)
class LendingDecision:
    action: LendingAction
    num_devices: int
    reason: str


def _hold(reason: str) -> LendingDecision:
    return LendingDecision(LendingAction.HOLD, 0, reason)


def _lend(obs: LendingObservation, policy: LendingPolicy, why: str) -> LendingDecision:
    """Shrink training to the largest size that frees the shortfall (or, failing that, the smallest
    size below the current one)."""
    wanted = math.ceil(obs.planning_rate / (obs.replica_capacity * policy.target_utilization))
    shortfall = max(1, wanted - obs.infer_devices)
    smaller = [size for size in obs.sizes() if size < obs.train_devices]
    if not smaller:
        return _hold(f"{why}, but training is at its minimum of {obs.min_train_devices} devices")
    enough = [size for size in smaller if size <= obs.train_devices - shortfall]
    devices = obs.train_devices - (max(enough) if enough else min(smaller))
    return LendingDecision(LendingAction.LEND, devices, f"{why}: lend {devices} for {wanted} wanted")


def _breach(obs: LendingObservation, policy: LendingPolicy) -> str | None:
    if obs.p99_latency_s > obs.slo_p99_s:
        return f"p99 {obs.p99_latency_s:.3f}s above the objective {obs.slo_p99_s:.3f}s"
    if obs.queue_depth > policy.queue_per_device * max(1, obs.infer_devices):
        return f"queue of {obs.queue_depth} over {policy.queue_per_device} per inference device"
    if obs.infer_devices < obs.min_infer_devices:
        return f"{obs.infer_devices} inference devices, fewer than the minimum {obs.min_infer_devices}"
    return None


def _reclaimable(obs: LendingObservation, policy: LendingPolicy) -> int:
    """The most devices inference can return (training growing to one of its sizes) while its
    utilization stays at or below reclaim_below."""
    best = 0
    for size in obs.sizes():
        returned = size - obs.train_devices
        remaining = obs.infer_devices - returned
        if returned <= 0 or remaining < obs.min_infer_devices:
            continue
        if obs.planning_rate <= policy.reclaim_below * remaining * obs.replica_capacity:
            best = max(best, returned)
    return best


def _unharvest(obs: LendingObservation, policy: LendingPolicy, why: str) -> LendingDecision:
    """Give back the fewest shared devices that bring utilization to the target (all of them if none does)."""
    enough = [kept for kept in range(obs.harvested_devices)
              if obs.utilization_with(kept) <= policy.target_utilization]
    devices = obs.harvested_devices - (max(enough) if enough else 0)
    return LendingDecision(LendingAction.UNHARVEST, devices, f"{why}: give {devices} shared device(s) back to inference")


def _harvestable(obs: LendingObservation, policy: LendingPolicy) -> int:
    """The most more inference devices training can share while utilization stays at or below harvest_below."""
    best = 0
    for harvested in range(obs.harvested_devices + 1, obs.infer_devices + 1):
        if obs.utilization_with(harvested) <= policy.harvest_below and obs.harvest_sizes_ok(harvested):
            best = harvested - obs.harvested_devices
    return best


def _short_of_devices(obs: LendingObservation, policy: LendingPolicy, why: str) -> LendingDecision:
    """Inference needs more: shared devices go back first (a regroup), whole devices only then (a replica start)."""
    if obs.harvested_devices:
        return _unharvest(obs, policy, why)
    return _lend(obs, policy, why)


def decide(obs: LendingObservation, policy: LendingPolicy | None = None) -> LendingDecision:
    """Lend, reclaim, harvest, give back or hold, from one observation of the pool."""
    policy = policy or LendingPolicy()
    breach = _breach(obs, policy)
    if breach is not None and obs.utilization < policy.breach_min_utilization:
        return _hold(f"{breach}, but utilization {obs.utilization:.2f} is below {policy.breach_min_utilization}: "
                     "a stall, not a shortage of devices")
    if breach is not None:
        if obs.seconds_since_change < policy.breach_cooldown_s:
            return _hold(f"{breach}; waiting for the last change to take effect")
        return _short_of_devices(obs, policy, breach)
    if obs.seconds_since_change < policy.cooldown_s:
        return _hold(f"cooling down ({obs.seconds_since_change:.1f}s of {policy.cooldown_s:g}s since the last change)")
    if obs.utilization > policy.lend_above:
        return _short_of_devices(obs, policy, f"utilization {obs.utilization:.2f} above {policy.lend_above}")
    if policy.harvest_below is not None:
        devices = _harvestable(obs, policy) if obs.p99_latency_s <= policy.reclaim_latency_fraction * obs.slo_p99_s else 0
        if devices:
            return LendingDecision(LendingAction.HARVEST, devices,
                                   f"utilization {obs.utilization_with(obs.harvested_devices + devices):.2f} stays at "
                                   f"or below {policy.harvest_below} with {devices} more device(s) shared with training")
        return _hold(f"utilization {obs.utilization:.2f}: no device to share or give back")
    if obs.p99_latency_s <= policy.reclaim_latency_fraction * obs.slo_p99_s:
        devices = _reclaimable(obs, policy)
        if devices:
            return LendingDecision(
                LendingAction.RECLAIM, devices,
                f"utilization {obs.utilization:.2f} stays at or below {policy.reclaim_below} with {devices} fewer devices",
            )
    if obs.utilization > policy.reclaim_below:
        return _hold(f"utilization {obs.utilization:.2f} within [{policy.reclaim_below}, {policy.lend_above}]")
    if obs.p99_latency_s > policy.reclaim_latency_fraction * obs.slo_p99_s:
        return _hold(f"utilization {obs.utilization:.2f} is low but p99 {obs.p99_latency_s:.2f}s is not well "
                     f"inside the objective {obs.slo_p99_s}s")
    return _hold(f"utilization {obs.utilization:.2f} is low, but no device can go back without serving "
                 f"going above {policy.reclaim_below} or below its minimum of {obs.min_infer_devices}")


def forecast_rate(samples: Sequence[tuple[float, float]], at: float, *, min_span_s: float = 1.0) -> float | None:
    """The request rate expected at time `at`, from a least-squares line through (time, rate) samples.

    None when the samples span less than `min_span_s` (no trend to speak of yet). Never negative.
    """
    if len(samples) < 2:
        return None
    times = [t for t, _ in samples]
    if max(times) - min(times) < min_span_s:
        return None
    mean_t = sum(times) / len(times)
    mean_r = sum(r for _, r in samples) / len(samples)
    slope = sum((t - mean_t) * (r - mean_r) for t, r in samples) / sum((t - mean_t) ** 2 for t in times)
    return max(0.0, mean_r + slope * (at - mean_t))
