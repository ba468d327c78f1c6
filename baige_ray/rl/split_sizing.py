"""Sizing a split GRPO run from what its phases measured: how many devices the rollout replicas hold and
how many the training workers do, decided after every iteration by policies/rl_split.py and carried out
between the refit and the next rollout, when the replicas hold the newest weights and the job waits at
its gate.

- Devices to the replicas: the job shrinks first (one regroup from its in-memory snapshot), then Serve
  starts replicas on the devices it released; they load the newest published weights as they start.
- Devices to the workers: Serve drains and stops replicas first, then the job grows onto their devices.

What a move costs is its measured seconds (the mean of the moves made), after a first guess.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Protocol

from baige_ray.api.validation import require_int, require_number
from baige_ray.policies.rl_split import PhaseSample, SplitDecision, SplitObservation, decide_split


@dataclasses.dataclass(kw_only=True, frozen=True)
class SplitSizing:
    """`pool_devices`: what the replicas and the workers may hold together (None: the pool's devices less
    the job's spares and the reference policy's share). A move is made when it saves at least `min_gain`
    of an iteration and, over the iterations left, more than it costs: `move_cost_s` at first, then the
    mean of the moves measured."""

    pool_devices: int | None = None
    min_gain: float = 0.1
    move_cost_s: float = 30.0

    def __post_init__(self) -> None:
        if self.pool_devices is not None:
            require_int("SplitSizing", "pool_devices", self.pool_devices, minimum=2)
        require_number("SplitSizing", "min_gain", self.min_gain, minimum=0, maximum=1)
        require_number("SplitSizing", "move_cost_s", self.move_cost_s, minimum=0)


@dataclasses.dataclass(frozen=True)
class SplitMove:
    after_iteration: int  # made after this iteration's refit
    replicas: tuple[int, int]  # before, after
    workers: tuple[int, int]
    seconds: float
    reason: str


class Replicas(Protocol):
    def scale(self, num_replicas: int) -> None: ...


class Workers(Protocol):
    def resize(self, num_workers: int, *, reason: str = "") -> int: ...


class SplitSizer:
    """Holds the phases' timings at each split and the moves made; decides and moves after an iteration."""

    def __init__(self, sizing: SplitSizing, *, pool_devices: int, train_sizes: tuple[int, ...], max_replicas: int,
                 num_iterations: int, replicas: int, workers: int):
        self.sizing, self.pool_devices, self.train_sizes = sizing, pool_devices, train_sizes
        self.max_replicas, self.num_iterations = max_replicas, num_iterations
        self.replicas, self.workers = replicas, workers
        self.rollout: list[PhaseSample] = []
        self.training: list[PhaseSample] = []
        self.moves: list[SplitMove] = []
        self.last_decision: SplitDecision | None = None

    def record(self, rollout_s: float, training_s: float) -> None:
        """One iteration's phases, at the split they ran on."""
        self.rollout.append(PhaseSample(self.replicas, rollout_s))
        self.training.append(PhaseSample(self.workers, training_s))

    def move_cost_s(self) -> float:
        return statistics.fmean(m.seconds for m in self.moves) if self.moves else self.sizing.move_cost_s

    def decide(self, iteration: int) -> SplitDecision:
        """The split for the iterations after `iteration`."""
        self.last_decision = decide_split(SplitObservation(
            rollout=tuple(self.rollout), training=tuple(self.training), replicas=self.replicas, workers=self.workers,
            pool_devices=self.pool_devices, train_sizes=self.train_sizes, max_replicas=self.max_replicas,
            iterations_left=self.num_iterations - 1 - iteration, move_cost_s=self.move_cost_s(),
            min_gain=self.sizing.min_gain))
        return self.last_decision

    def move(self, iteration: int, decision: SplitDecision, replicas: Replicas, workers: Workers) -> SplitMove:
        """Carry the decision out: whoever gives devices up does so before the other side takes them."""
        started = time.perf_counter()
        reason = f"rl split after iteration {iteration}: {decision.reason}"
        if decision.workers < self.workers:
            workers.resize(decision.workers, reason=reason)
        if decision.replicas != self.replicas:
            replicas.scale(decision.replicas)
        if decision.workers > self.workers:
            workers.resize(decision.workers, reason=reason)
        move = SplitMove(iteration, (self.replicas, decision.replicas), (self.workers, decision.workers),
                         time.perf_counter() - started, decision.reason)
        self.replicas, self.workers = decision.replicas, decision.workers
        self.moves.append(move)
        return move


class ServeReplicas:
    """A `serve()` application's replica count, set and waited for (stopping replicas have given their
    devices back once it returns)."""

    def __init__(self, info: Any):
        self.info = info

    def scale(self, num_replicas: int) -> None:
        from baige_ray.serving.app import scale_replicas

        scale_replicas(self.info, num_replicas)


def pool_devices_for(sizing: SplitSizing, pool_gpus: float, *, spares: int, spare_share: float,
                     reference_share: float) -> int:
    """The devices a split run's replicas and workers may hold: configured, or the pool's whole devices
    less what the spares and the reference policy hold."""
    if sizing.pool_devices is not None:
        return sizing.pool_devices
    whole = int(pool_gpus - spares * spare_share - reference_share + 1e-9)
    if whole < 2:
        raise ValueError(f"RolloutOptions.sizing needs a pool of devices: the cluster has {pool_gpus:g} GPUs "
                         f"({whole} left for replicas and workers); set SplitSizing.pool_devices")
    return whole


def job_sizes(status: dict[str, Any]) -> tuple[int, ...]:
    return tuple(int(size) for size in status["sizes"])
