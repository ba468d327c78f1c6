"""How a split GRPO run divides its devices between rollout replicas and training workers (pure, no Ray).

An iteration runs its phases in turn, rollout then training, so its time is their sum and a device speeds
only the phase that holds it. Each phase's time on n devices is modeled from what it measured as
t(n) = serial + parallel / n: fitted by least squares on the medians of the sizes it ran at where there
are two or more, and taken as all parallel where there is one (an optimistic guess, which the move it
prompts then measures). A split's prediction is the sum of its phases' predictions.

A move costs time once (training regroups; replicas start, load the weights, or drain), and saves the
difference at every iteration left. The policy moves to the split with the best prediction only when that
saving, times the iterations left, exceeds the cost of a move, and saves at least `min_gain` of the
iteration as it is: a split measured at two sizes is not left for a guess within noise of it.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import defaultdict
from collections.abc import Sequence

from baige_ray.api.validation import require_int, require_number


@dataclasses.dataclass(frozen=True)
class PhaseSample:
    devices: int  # replicas for a rollout, workers for a training step
    seconds: float


@dataclasses.dataclass(frozen=True)
class PhaseModel:
    """t(n) = serial + parallel / n seconds on n devices."""

    serial: float
    parallel: float

    def seconds(self, devices: int) -> float:
        return self.serial + self.parallel / devices


@dataclasses.dataclass(kw_only=True, frozen=True)
class SplitObservation:
    rollout: tuple[PhaseSample, ...]  # each iteration's rollout, by the replicas that ran it
    training: tuple[PhaseSample, ...]  # each iteration's training, by the workers that ran it
    replicas: int
    workers: int
    pool_devices: int  # what replicas and workers may hold together
    train_sizes: tuple[int, ...]  # worker counts the job can run at
    max_replicas: int  # beyond it a replica would have no group to decode
    iterations_left: int
    move_cost_s: float
    min_gain: float = 0.1

    def __post_init__(self) -> None:
        for name in ("replicas", "workers", "pool_devices", "max_replicas"):
            require_int("SplitObservation", name, getattr(self, name), minimum=1)
        require_int("SplitObservation", "iterations_left", self.iterations_left, minimum=0)
        require_number("SplitObservation", "move_cost_s", self.move_cost_s, minimum=0)
        require_number("SplitObservation", "min_gain", self.min_gain, minimum=0, maximum=1)
        if not self.train_sizes or any(size < 1 for size in self.train_sizes):
            raise ValueError(f"SplitObservation.train_sizes={self.train_sizes!r} is invalid: "
                             "expected worker counts >= 1")


@dataclasses.dataclass(frozen=True)
class SplitDecision:
    replicas: int
    workers: int
    predicted_s: float  # an iteration at the chosen split
    current_s: float  # an iteration at the split as it is, predicted the same way
    reason: str

    def moves_from(self, replicas: int, workers: int) -> bool:
        return (self.replicas, self.workers) != (replicas, workers)


def fit_phase(samples: Sequence[PhaseSample]) -> PhaseModel | None:
    """The phase's model from its samples (None without any): least squares of the per-size medians
    against 1 / n, with neither part negative."""
    by_size: dict[int, list[float]] = defaultdict(list)
    for sample in samples:
        by_size[sample.devices].append(sample.seconds)
    points = [(1.0 / n, statistics.median(seconds)) for n, seconds in by_size.items()]
    if not points:
        return None
    if len(points) == 1:
        x, t = points[0]
        return PhaseModel(serial=0.0, parallel=t / x)
    mean_x = statistics.fmean(x for x, _ in points)
    mean_t = statistics.fmean(t for _, t in points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (t - mean_t) for x, t in points) / spread
    if slope <= 0:  # more devices did not help: all serial
        return PhaseModel(serial=mean_t, parallel=0.0)
    serial = mean_t - slope * mean_x
    if serial < 0:  # through the origin instead
        return PhaseModel(serial=0.0, parallel=sum(x * t for x, t in points) / sum(x * x for x, _ in points))
    return PhaseModel(serial=serial, parallel=slope)


def candidate_splits(obs: SplitObservation) -> list[tuple[int, int]]:
    """(replicas, workers) the pool can hold: the split as it is, and every other within the limits."""
    splits = {(obs.replicas, obs.workers)}
    for workers in obs.train_sizes:
        for replicas in range(1, min(obs.max_replicas, obs.pool_devices - workers) + 1):
            splits.add((replicas, workers))
    return sorted(splits)


def decide_split(obs: SplitObservation) -> SplitDecision:
    rollout, training = fit_phase(obs.rollout), fit_phase(obs.training)
    current = (obs.replicas, obs.workers)
    if rollout is None or training is None:
        return SplitDecision(*current, predicted_s=float("nan"), current_s=float("nan"),
                             reason="nothing measured yet")

    def predicted(split: tuple[int, int]) -> float:
        return rollout.seconds(split[0]) + training.seconds(split[1])

    now = predicted(current)
    best = min(candidate_splits(obs), key=lambda split: (predicted(split), split != current))
    saving = now - predicted(best)
    shape = (f"rollout {rollout.serial:.3g} + {rollout.parallel:.3g}/n s, "
             f"training {training.serial:.3g} + {training.parallel:.3g}/n s")
    if best == current:
        return SplitDecision(*current, predicted_s=now, current_s=now, reason=f"the split is the best ({shape})")
    if saving < obs.min_gain * now:
        return SplitDecision(*current, predicted_s=now, current_s=now,
                             reason=f"{best[0]} replicas + {best[1]} workers would save {saving:.3g} s of {now:.3g} s, "
                                    f"under min_gain {obs.min_gain:g} ({shape})")
    if saving * obs.iterations_left <= obs.move_cost_s:
        return SplitDecision(*current, predicted_s=now, current_s=now,
                             reason=f"{best[0]} replicas + {best[1]} workers would save {saving:.3g} s x "
                                    f"{obs.iterations_left} iterations left, not the {obs.move_cost_s:.3g} s a move "
                                    f"costs ({shape})")
    return SplitDecision(*best, predicted_s=predicted(best), current_s=now,
                         reason=f"{best[0]} replicas + {best[1]} workers: {predicted(best):.3g} s an iteration "
                                f"against {now:.3g} s ({shape})")
