"""Fault injection, a first-class test and benchmark utility.

A `FaultPlan` schedules crashes, hangs and slowdowns at (rank, step), and crashes
in the middle of a regroup (a member lost while the others wait for it). The
controller owns the plan and arms each fault once, on the worker that holds the
rank when the step first runs (or the regroup happens), so a replacement re-running
that step is healthy.
Workers carry the fault out in their own process: a crash exits it, a hang stops
it (SIGSTOP: it answers nothing, like a process wedged in a driver call), a
slowdown makes its chip emulate a lower speed from then on.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from enum import Enum

from baige_ray.failpoints import FAIL_POINTS, arm_fail_point


class FaultKind(Enum):
    CRASH = "crash"
    HANG = "hang"
    SLOW = "slow"


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    rank: int
    step: int
    speed: float = 0.25  # SLOW only: the chip's emulated speed from this step on
    regrouping: bool = False  # in the first regroup at `step` or later, before the rank joins
    at: str | None = None  # CRASH only: inside the step, at this fail point (baige_ray/failpoints.py)

    def __post_init__(self) -> None:
        if self.rank < 0 or self.step < 0:
            raise ValueError(f"Fault(rank={self.rank}, step={self.step}) is invalid: expected rank >= 0 and step >= 0")
        if self.at is not None and (self.kind is not FaultKind.CRASH or self.regrouping):
            raise ValueError(f"Fault.at={self.at!r} is invalid for a {self.kind.value} fault"
                             f"{' while regrouping' if self.regrouping else ''}: only a step's crash has a place")
        if self.at is not None and self.at not in FAIL_POINTS:
            raise ValueError(f"Fault.at={self.at!r} is invalid: expected one of {', '.join(FAIL_POINTS)}")
        if not 0 < self.speed <= 1:
            raise ValueError(f"Fault.speed={self.speed!r} is invalid: expected 0 < speed <= 1")


@dataclass
class FaultPlan:
    faults: list[Fault] = field(default_factory=list)
    fired: list[Fault] = field(default_factory=list)

    def crash(self, rank: int, step: int, at: str | None = None) -> FaultPlan:
        """Crash the worker at `rank` as step `step` begins or, with `at`, inside it: at fail point
        "sampling" (a hybrid GRPO rank's rollout, mid-batch) or "backward" (mid-training)."""
        self.faults.append(Fault(FaultKind.CRASH, rank, step, at=at))
        return self

    def hang(self, rank: int, step: int) -> FaultPlan:
        self.faults.append(Fault(FaultKind.HANG, rank, step))
        return self

    def slow(self, rank: int, step: int, speed: float = 0.25) -> FaultPlan:
        self.faults.append(Fault(FaultKind.SLOW, rank, step, speed))
        return self

    def crash_while_regrouping(self, rank: int, step: int) -> FaultPlan:
        """Crash the worker at `rank` in the first regroup at `step` or later (a recovery, a resize),
        after the others have begun waiting for it to join."""
        self.faults.append(Fault(FaultKind.CRASH, rank, step, regrouping=True))
        return self

    def arm(self, step: int) -> dict[int, Fault]:
        """Faults due at `step`, by rank; each is handed out once and counted as fired."""
        return self._hand_out([f for f in self.faults if not f.regrouping and f.step == step])

    def arm_regroup(self, step: int) -> dict[int, Fault]:
        """Faults due in a regroup that resumes at `step`, by rank; each handed out once."""
        return self._hand_out([f for f in self.faults if f.regrouping and f.step <= step])

    def _hand_out(self, due: list[Fault]) -> dict[int, Fault]:
        by_rank = {fault.rank: fault for fault in due if fault not in self.fired}
        self.fired.extend(by_rank.values())
        return by_rank

    def count(self, kind: FaultKind) -> int:
        return sum(1 for fault in self.fired if fault.kind is kind)


def carry_out(fault: Fault, set_speed) -> None:
    """Run inside the worker process at the start of the faulty step (a crash with a place is armed there)."""
    if fault.at is not None:
        arm_fail_point(fault.at)
    elif fault.kind is FaultKind.CRASH:
        os._exit(17)  # no cleanup, like a segfault or an OOM kill
    if fault.kind is FaultKind.HANG:
        os.kill(os.getpid(), signal.SIGSTOP)
    if fault.kind is FaultKind.SLOW:
        set_speed(fault.speed)
